"""The worker protocol's SamplingParams: what a gateway sends, through JSON, is what the worker
rebuilds, reasoning budget included; a malformed budget is refused by name."""

from __future__ import annotations

import json

import pydantic
import pytest

from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import ReasoningBudget, SamplingParams, StructuredOutputSpec
from tokenway.routing import wire


def through_the_wire(params: SamplingParams) -> SamplingParams:
    body = {"request_id": "r", "prompt_token_ids": [1, 2], "params": wire.params_to_dict(params)}
    body = json.loads(json.dumps(body))
    return wire.params_from_wire(wire.GenerateBody.model_validate(body).params)


@pytest.mark.parametrize("budget", [
    ReasoningBudget(512, end_token_ids=(151668, 271), start_token_ids=(151667,)),
    ReasoningBudget(0, end_token_ids=(7,), starts_open=True),
    None,
])
def test_a_reasoning_budget_crosses_the_wire_whole(budget):
    params = SamplingParams(temperature=0.6, max_tokens=900, reasoning_budget=budget,
                            structured_output=StructuredOutputSpec.json_object())
    assert through_the_wire(params) == params


def test_a_malformed_budget_is_refused_by_name():
    def params(**budget) -> dict:
        return {"request_id": "r", "prompt_token_ids": [1], "params": {"reasoning_budget": budget}}

    with pytest.raises(FieldError) as negative:
        wire.params_from_wire(wire.GenerateBody.model_validate(params(max_tokens=-1, end_token_ids=[7],
                                                                      starts_open=True)).params)
    assert negative.value.param == "reasoning_budget"
    with pytest.raises(FieldError, match="start_token_ids") as unopenable:
        wire.params_from_wire(wire.GenerateBody.model_validate(params(max_tokens=4, end_token_ids=[7])).params)
    assert unopenable.value.param == "reasoning_budget"
    for bad in ({"max_tokens": 4, "end_token_ids": ["7"], "starts_open": True},
                {"max_tokens": True, "end_token_ids": [7], "starts_open": True},
                {"max_tokens": 4, "end_token_ids": [7], "starts_open": True, "budget": 3}):
        with pytest.raises(pydantic.ValidationError):
            wire.GenerateBody.model_validate(params(**bad))


def test_the_service_class_crosses_the_wire_and_an_unknown_one_is_refused():
    body = {"request_id": "r", "prompt_token_ids": [1], "params": {}}
    assert wire.GenerateBody.model_validate(body).service_class == "default"  # a gateway older than classes
    for service_class in ("priority", "flex", "batch"):
        parsed = wire.GenerateBody.model_validate_json(json.dumps({**body, "service_class": service_class}))
        assert parsed.service_class == service_class
    with pytest.raises(pydantic.ValidationError, match="service_class"):
        wire.GenerateBody.model_validate({**body, "service_class": "scale"})
