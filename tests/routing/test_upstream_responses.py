"""ResponsesUpstream against a real HTTP server on loopback: the exact Responses body a chat job
becomes, the typed events it reads back as ChoiceDeltas (text, tool calls, thinking) and one
Usage (cached and reasoning tokens included), how a response ends (completed, incomplete,
failed), errors keeping their kind, n choices as concurrent calls, and a hang-up on close."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenway.protocol.errors import BadGatewayError, InvalidRequestError, RateLimitError
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ToolCallDelta, Usage
from tokenway.protocol.sampling import SamplingParams, ThinkingRequest, effort_thinking
from tokenway.routing.responses_upstream import ResponsesUpstream

from .stub_upstream import (
    Reply,
    StubUpstream,
    call_item,
    collect,
    reasoning_item,
    reassemble_tool_calls,
    responses_event,
    responses_final,
    text_item,
)

USER = ({"role": "user", "content": "hi"},)
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.fixture()
def stub():
    with StubUpstream() as server:
        yield server


def make_job(deadline: float | None = None, **fields) -> GenerationJob:
    """A streamed caller's job: the upstream is sent stream=true (test_upstream_unstreamed.py: the other road)."""
    fields.setdefault("messages", USER)
    fields.setdefault("params", SamplingParams(max_tokens=32))
    fields.setdefault("stream", True)
    return GenerationJob("req-1", "served", fields.pop("kind", "chat"), deadline=deadline, **fields)


def upstream_for(stub: StubUpstream, **options) -> ResponsesUpstream:
    return ResponsesUpstream("gpt-next", stub.base_url, "gpt-up", **options)


CREATED = responses_event("response.created", response={"id": "resp_up", "status": "in_progress"})


def test_a_chat_job_becomes_the_exact_responses_body(stub):
    stub.script(Reply(chunks=(CREATED, *text_item(0, "ok"), responses_final())))
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Rome?"}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants Rome.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    )
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    job = make_job(messages=messages, tools=(WEATHER_TOOL,), tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}},
                   parallel_tool_calls=False, thinking=effort_thinking("high"),
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                           "strict": True}},
                   params=SamplingParams(temperature=0.2, top_p=0.9, max_tokens=64, logprobs=2, seed=7))
    events = collect(upstream_for(stub), job)
    assert events == [ChoiceDelta(0, text="ok"), ChoiceDelta(0, finish_reason="stop"), Usage(10, 5)]
    (received,) = stub.received
    assert (received.method, received.path) == ("POST", "/v1/responses")
    assert received.body == {
        "model": "gpt-up", "store": False, "stream": True, "temperature": 0.2, "top_p": 0.9, "max_output_tokens": 64,
        "top_logprobs": 2, "include": ["message.output_text.logprobs"],
        "input": [
            {"type": "message", "role": "system", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                             {"type": "input_text", "text": "Rome?"}]},
            {"type": "message", "role": "assistant", "content": "Checking."},  # its thinking is not sent back
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                   "parameters": WEATHER_TOOL["function"]["parameters"], "strict": False}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}},
        "reasoning": {"effort": "high"},
    }


@pytest.mark.parametrize("thinking, effort", [
    (None, None), (ThinkingRequest(enabled=False), "none"), (ThinkingRequest(enabled=True), None),
    (ThinkingRequest(budget_tokens=100), "minimal"), (ThinkingRequest(budget_tokens=3000), "medium"),
    (ThinkingRequest(enabled=True, budget_tokens=100_000), "xhigh"),
])
def test_a_thinking_request_goes_as_the_nearest_effort_at_or_below_its_budget(stub, thinking, effort):
    stub.script(Reply(chunks=(*text_item(0, "ok"), responses_final())))
    collect(upstream_for(stub), make_job(thinking=thinking))
    assert stub.received[0].body.get("reasoning") == ({"effort": effort} if effort else None)


@pytest.mark.parametrize("fields, param", [
    ({"kind": "completion", "prompt": "Once", "messages": ()}, "prompt"),
    ({"params": SamplingParams(stop=("END",))}, "stop"),
    ({"params": SamplingParams(logit_bias={5: 1.0})}, "logit_bias"),
    ({"response_format": {"type": "regex", "pattern": "a+"}}, "response_format"),
    ({"messages": ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},)},
     "messages[0].content[0]"),
])
def test_what_the_responses_api_cannot_take_is_refused_before_calling(stub, fields, param):
    stub.script(Reply(chunks=(responses_final(),)))
    with pytest.raises(InvalidRequestError) as caught:
        collect(upstream_for(stub), make_job(**fields))
    assert caught.value.param == param and stub.received == []


def test_thinking_text_and_tool_calls_stream_as_deltas_with_the_upstreams_usage(stub):
    stub.script(Reply(chunks=(
        CREATED, *reasoning_item(0, "reasoning_text", "Rome and ", "Paris."), *text_item(1, "Let me ", "check."),
        *call_item(2, "call_a", '{"ci', 'ty": "Rome"}'), *call_item(3, "call_b", '{"city": "Paris"}'),
        responses_final(input_tokens=40, output_tokens=30, cached_tokens=32, reasoning_tokens=12))))
    events = collect(upstream_for(stub), make_job(tools=(WEATHER_TOOL,)))
    assert events[:5] == [ChoiceDelta(0, reasoning="Rome and "), ChoiceDelta(0, reasoning="Paris."),
                          ChoiceDelta(0, text="Let me "), ChoiceDelta(0, text="check."),
                          ChoiceDelta(0, tool_calls=(ToolCallDelta(0, id="call_a", name="get_weather"),))]
    assert reassemble_tool_calls(events) == [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"id": "call_b", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    ]
    assert events[-2:] == [ChoiceDelta(0, finish_reason="tool_calls"),
                           Usage(40, 30, cached_tokens=32, reasoning_tokens=12)]


def test_a_reasoning_summary_is_the_thinking_an_upstream_shows(stub):
    stub.script(Reply(chunks=(*reasoning_item(0, "reasoning_summary_text", "**Greeting**"), *text_item(1, "Hi"),
                              responses_final(reasoning_tokens=64))))
    events = collect(upstream_for(stub), make_job())
    assert events[:2] == [ChoiceDelta(0, reasoning="**Greeting**"), ChoiceDelta(0, text="Hi")]


def test_logprobs_come_back_in_chats_entry_shape(stub):
    delta = responses_event("response.output_text.delta", item_id="msg_0", output_index=0, content_index=0,
                            delta="Hi", logprobs=[{"token": "Hi", "logprob": -0.5,
                                                   "top_logprobs": [{"token": "Hey", "logprob": -1.5}]}])
    stub.script(Reply(chunks=(delta, responses_final())))
    [text, _, _] = collect(upstream_for(stub), make_job(params=SamplingParams(max_tokens=4, logprobs=1)))
    assert text.logprobs == ({"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                              "top_logprobs": [{"token": "Hey", "logprob": -1.5, "bytes": [72, 101, 121]}]},)


@pytest.mark.parametrize("reason, finish_reason", [("max_output_tokens", "length"),
                                                   ("content_filter", "content_filter")])
def test_an_incomplete_response_ends_with_its_reason(stub, reason, finish_reason):
    stub.script(Reply(chunks=(*text_item(0, "Once upon"), responses_final("incomplete", incomplete_reason=reason))))
    events = collect(upstream_for(stub), make_job())
    assert events[-2] == ChoiceDelta(0, finish_reason=finish_reason)


def test_an_upstream_without_usage_is_counted_by_the_tokenizer(stub):
    final = responses_event("response.completed", response={"id": "resp_up", "status": "completed"})
    stub.script(Reply(chunks=(*text_item(0, "Hel", "lo"), final)))
    events = collect(upstream_for(stub, count_tokens=lambda job, texts: (8, len("".join(texts)))), make_job())
    assert events[-1] == Usage(8, 5, counted_by="tokenizer")


def test_n_choices_run_as_concurrent_calls_and_sum_their_usage(stub):
    stub.script(Reply(chunks=(*text_item(0, "same"), responses_final(input_tokens=10, output_tokens=3))))
    events = collect(upstream_for(stub), make_job(n=2))
    assert len(stub.received) == 2 and stub.received[0].body == stub.received[1].body
    for index in (0, 1):
        assert [event for event in events if isinstance(event, ChoiceDelta) and event.index == index] == [
            ChoiceDelta(index, text="same"), ChoiceDelta(index, finish_reason="stop")]
    assert events[-1] == Usage(20, 6)


@pytest.mark.parametrize("failure, kind", [
    (responses_event("response.failed", response={"id": "resp_up", "status": "failed",
                                                  "error": {"code": "rate_limit_exceeded", "message": "Slow down"}}),
     RateLimitError),
    (responses_event("response.failed", response={"id": "resp_up", "status": "failed",
                                                  "error": {"code": "server_error", "message": "boom"}}),
     BadGatewayError),
    (responses_event("error", code="invalid_prompt", message="Your prompt was flagged.", param=None),
     InvalidRequestError),
])
def test_a_failed_response_and_an_error_event_keep_their_kind(stub, failure, kind):
    stub.script(Reply(chunks=(*text_item(0, "x"), failure)))
    with pytest.raises(kind):
        collect(upstream_for(stub), make_job())


@pytest.mark.parametrize("reply", [
    Reply(chunks=text_item(0, "x")),  # the body ends without response.completed
    Reply(chunks=(responses_event("response.function_call_arguments.delta", output_index=4, delta="{"),)),
    Reply(chunks=(b"event: response.output_text.delta\ndata: {\"delta\": \n\n",)),
])
def test_cut_and_malformed_streams_are_bad_gateway(stub, reply):
    stub.script(reply)
    with pytest.raises(BadGatewayError):
        collect(upstream_for(stub), make_job(deadline=time.monotonic() + 5))
    assert stub.wait_for(lambda: stub.num_open_connections == 0)


def test_aclose_mid_stream_hangs_up_on_the_upstream(stub):
    stub.script(Reply(chunks=text_item(0, "one", "two")[:3], then="hang"))

    async def main():
        async with upstream_for(stub) as upstream:
            events = upstream.generate(make_job())
            assert await anext(events) == ChoiceDelta(0, text="one")
            await events.aclose()
            return await asyncio.to_thread(stub.wait_for, lambda: stub.num_disconnects == 1)

    assert asyncio.run(main())
