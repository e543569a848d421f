"""The results files' lines as the official SDKs read them: Anthropic's results lines validate
as the anthropic SDK's MessageBatchIndividualResponse; OpenAI's output and error lines carry
bodies the openai SDK reads (its ChatCompletion; BatchError's code and message)."""

import json

import pytest
from anthropic.types.messages import MessageBatchIndividualResponse
from openai.types import BatchError
from openai.types.chat import ChatCompletion

from tokenway.batches import LineOutcome
from tokenway.batches.runner import failed_outcome

from .conftest import NOW, make_batch, succeeded

pytestmark = pytest.mark.anyio

ANTHROPIC_ERROR = {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too large"},
                   "request_id": "req_2"}


async def run_four_ways(store, api: str) -> list[dict]:
    """A batch of five lines: succeeded, failed (answered), failed (raised), cancelled, and one
    more cancelled; its results files' lines, output file first."""
    batch = await make_batch(store, 5, api=api)
    lines = await store.claim("w1", 3, 60, NOW)
    await store.finish("w1", lines[0], succeeded(0, api))
    error_body = ANTHROPIC_ERROR if api == "anthropic" else {"error": {
        "message": "max_tokens: too large", "type": "invalid_request_error", "param": "max_tokens", "code": None}}
    await store.finish("w1", lines[1], LineOutcome("failed", 400, error_body, None, "req_1"))
    await store.finish("w1", lines[2], failed_outcome(lines[2], ValueError("bad state")))
    await store.cancel_batch(batch.id, "key-a")
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "cancelled"
    lines_out = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id is not None:
            lines_out += [json.loads(line) for line in (await store.file_content(file_id, "key-a")).splitlines()]
    return lines_out


async def test_anthropic_results_lines_validate_as_the_sdks(store):
    results = await run_four_ways(store, "anthropic")
    parsed = [MessageBatchIndividualResponse.model_validate(line) for line in results]
    assert [(r.custom_id, r.result.type) for r in parsed] == [
        ("req-0", "succeeded"), ("req-1", "errored"), ("req-2", "errored"), ("req-3", "canceled"),
        ("req-4", "canceled")]
    assert parsed[0].result.message.content[0].text == "answer 0"
    assert parsed[1].result.error.error.type == "invalid_request_error"
    assert parsed[2].result.error.error.type == "api_error"
    assert "ValueError: bad state" in parsed[2].result.error.error.message
    assert results[0] == {"custom_id": "req-0", "result": {"type": "succeeded", "message": succeeded(0, "anthropic")
                                                           .response}}


async def test_openai_output_and_error_lines_read_as_the_sdks(store):
    output_line, *error_lines = await run_four_ways(store, "openai")
    for line in [output_line, *error_lines]:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["id"].startswith("batch_req_")
    completion = ChatCompletion.model_validate(output_line["response"]["body"])
    assert completion.choices[0].message.content == "answer 0" and output_line["error"] is None
    assert output_line["response"]["status_code"] == 200 and output_line["response"]["request_id"] == "req_0"
    answered, raised, *cancelled = error_lines
    assert answered["response"]["status_code"] == 400 and answered["error"] is None
    assert answered["response"]["body"]["error"]["param"] == "max_tokens"
    assert raised["response"]["status_code"] == 500
    assert raised["response"]["body"]["error"]["type"] == "internal_error"
    for line in cancelled:
        error = BatchError.model_validate(line["error"])
        assert line["response"] is None and error.code == "batch_cancelled" and error.message
