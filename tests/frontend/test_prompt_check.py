"""PromptChecker: what the engine would refuse, refused on the caller's side by the field at
fault, before any byte of a stream."""

from __future__ import annotations

import pytest

from tokenway.frontend.prompt_check import PromptChecker
from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import ReasoningBudget, SamplingParams

VOCAB = 100


def checker() -> PromptChecker:
    return PromptChecker(VOCAB, max_model_len=32, structured_output=None)  # type: ignore[arg-type]  # no grammar here


@pytest.mark.parametrize("params, field", [
    (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (SamplingParams(reasoning_budget=ReasoningBudget(4, end_token_ids=(7, VOCAB), starts_open=True)),
     "reasoning_budget"),
    (SamplingParams(reasoning_budget=ReasoningBudget(4, end_token_ids=(7,), start_token_ids=(-1,))),
     "reasoning_budget"),
])
def test_token_ids_outside_the_vocabulary_are_refused_by_field(params, field):
    with pytest.raises(FieldError) as caught:
        checker().check([1, 2, 3], params)
    assert caught.value.param == field and f"[0, {VOCAB})" in str(caught.value)


def test_a_budget_within_the_vocabulary_passes():
    checker().check([1, 2, 3], SamplingParams(reasoning_budget=ReasoningBudget(4, (7, 8), (6,))))


def test_a_prompt_over_the_window_is_refused():
    with pytest.raises(FieldError, match="context window of 32"):
        checker().check(list(range(32)), SamplingParams())


def test_sampling_params_take_only_a_reasoning_budget():
    with pytest.raises(FieldError, match="must be a ReasoningBudget"):
        SamplingParams(reasoning_budget={"max_tokens": 3})  # type: ignore[arg-type]
