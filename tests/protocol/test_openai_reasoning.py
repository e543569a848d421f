"""A reasoning model's thinking on chat completions, in front of a scripted replica that splits
it itself (as an upstream does): message.reasoning_content and delta.reasoning_content, under
vLLM's newer name `reasoning` too, and usage.completion_tokens_details.reasoning_tokens, are the
SDK's types with only those keys added; reasoning_effort and chat_template_kwargs are accepted
and reach the job; thinking passed back reaches the replica's messages."""

from typing import Any

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tokenway.protocol.errors import InvalidRequestError, from_validation_error
from tokenway.protocol.job import ChoiceDelta, Usage
from tokenway.protocol.openai import ChatCompletionRequest
from tokenway.protocol.sampling import ThinkingRequest

from .conftest import MODEL, sse_events, validate_strictly

BODY = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 16}
EVENTS = [
    ChoiceDelta(0, reasoning="Two and two "),
    ChoiceDelta(0, reasoning="make four."),
    ChoiceDelta(0, text="It is 4.", finish_reason="stop"),
    Usage(prompt_tokens=9, completion_tokens=11, reasoning_tokens=7),
]
MESSAGE_EXTENSIONS = frozenset({"choices.message.reasoning_content", "choices.message.reasoning"})
DELTA_EXTENSIONS = frozenset({"choices.delta.reasoning_content", "choices.delta.reasoning"})


def test_a_completions_thinking_is_sent_apart_under_both_names(scripted):
    body = scripted.answer("/v1/chat/completions", BODY, EVENTS).json()
    completion = validate_strictly(ChatCompletion, body, MESSAGE_EXTENSIONS)
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == (
        "Two and two make four.", "Two and two make four.", "It is 4.")
    assert completion.usage.completion_tokens_details.reasoning_tokens == 7  # the replica's own count wins


def test_a_streams_thinking_deltas_carry_only_thinking(scripted):
    response = scripted.answer("/v1/chat/completions", {**BODY, "stream": True,
                                                        "stream_options": {"include_usage": True}}, EVENTS)
    *events, done = sse_events(response.text)
    chunks = [validate_strictly(ChatCompletionChunk, data, DELTA_EXTENSIONS) for _, data in events]
    assert [data["choices"][0]["delta"] for _, data in events[:-1]] == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "Two and two ", "reasoning": "Two and two "},
        {"reasoning_content": "make four.", "reasoning": "make four."},
        {"content": "It is 4."},
        {},
    ]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 7 and done == (None, "[DONE]")


def test_a_replica_that_counts_no_thinking_tokens_has_them_estimated(scripted):
    events = [*EVENTS[:3], Usage(prompt_tokens=9, completion_tokens=11)]
    body = scripted.answer("/v1/chat/completions", BODY, events).json()
    # ceil(12 / 4) + ceil(10 / 4): OpenAI's rule of thumb, per piece as it came
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    no_thinking = scripted.answer("/v1/chat/completions", BODY, [ChoiceDelta(0, text="4", finish_reason="stop")])
    assert "reasoning_content" not in no_thinking.json()["choices"][0]["message"]
    assert no_thinking.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_effort_and_template_kwargs_reach_the_job_and_thinking_passed_back_its_messages(scripted):
    client = openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0,
                           http_client=httpx2.Client(transport=scripted.sdk_transport()))
    scripted.replica.events = EVENTS
    messages: list[Any] = [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Easy."},
                {"role": "user", "content": "And 3 + 3?"}]
    client.chat.completions.create(model=MODEL, messages=messages, reasoning_effort="low",
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    job = scripted.replica.jobs[-1]
    assert job.thinking == ThinkingRequest(enabled=True, budget_tokens=1024)
    assert job.messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "Easy.", "reasoning": "Easy."}
    client.chat.completions.create(model=MODEL, messages=messages[:1], reasoning_effort="none")
    assert scripted.replica.jobs[-1].thinking == ThinkingRequest(enabled=False)


@pytest.mark.parametrize("patch, message", [
    ({"reasoning_effort": "max"},
     "reasoning_effort: must be one of none, minimal, low, medium, high, xhigh, got 'max'"),
    ({"reasoning_effort": 3}, None),
    ({"chat_template_kwargs": ["enable_thinking"]}, None),
])
def test_invalid_reasoning_fields(patch, message):
    try:
        ChatCompletionRequest.model_validate({"model": "m", **BODY, **patch})
    except Exception as exc:  # pydantic's ValidationError, read as the API reads it
        err = from_validation_error(exc.errors())  # type: ignore[attr-defined]
    else:
        raise AssertionError("accepted")
    assert type(err) is InvalidRequestError and err.param == next(iter(patch))
    assert message is None or err.message == message
