"""AnthropicUpstream against a real HTTP server on loopback: an OpenAI-format job becomes the
exact Messages body (system, tools, tool_use and tool_result turns), the event stream becomes
ChoiceDeltas and one Usage, failures keep their kind, n > 1 runs n calls and cleans up after
the first failure."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenway.protocol.anthropic import MessagesRequest, to_chat_messages, to_chat_tools
from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
    anthropic_error_body,
)
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ToolCallDelta, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.anthropic_upstream import AnthropicUpstream, to_anthropic_tool_choice
from tokenway.routing.upstream import sum_usages

from .stub_upstream import Reply, StubUpstream, anthropic_event, collect, reassemble_tool_calls

USER = ({"role": "user", "content": "hi"},)
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
WEATHER_SCHEMA = WEATHER_TOOL["function"]["parameters"]


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


def upstream_for(stub: StubUpstream, **options) -> AnthropicUpstream:
    return AnthropicUpstream("claude", stub.base_url, "claude-x", **options)


def test_an_upstream_is_a_replica_that_publishes_no_engine_stats(stub):
    assert upstream_for(stub).stats() is None


def message_start(input_tokens: int = 10, **usage) -> bytes:
    return anthropic_event("message_start", message={
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-x",
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1, **usage}})


def text_block(index: int, *pieces: str) -> tuple[bytes, ...]:
    return (anthropic_event("content_block_start", index=index, content_block={"type": "text", "text": ""}),
            *(anthropic_event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
              for piece in pieces),
            anthropic_event("content_block_stop", index=index))


def tool_block(index: int, id: str, name: str, *fragments: str) -> tuple[bytes, ...]:
    return (anthropic_event("content_block_start", index=index,
                            content_block={"type": "tool_use", "id": id, "name": name, "input": {}}),
            *(anthropic_event("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                         "partial_json": fragment})
              for fragment in fragments),
            anthropic_event("content_block_stop", index=index))


def message_end(stop_reason: str = "end_turn", output_tokens: int = 5, stop_sequence: str | None = None
                ) -> tuple[bytes, ...]:
    return (anthropic_event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage={"output_tokens": output_tokens}),
            anthropic_event("message_stop"))


HELLO = (message_start(), *text_block(0, "Hel", "lo"), *message_end())


# ---- the request body ------------------------------------------------------------------------------


def test_an_openai_conversation_with_tools_becomes_the_exact_messages_body(stub, monkeypatch):
    monkeypatch.setenv("CLAUDE_KEY", "sk-ant-secret")
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                     {"type": "text", "text": "and Rome?"}]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "24C"},
        {"role": "user", "content": "Thanks. Which is warmer?"},
    )
    params = SamplingParams(temperature=0.3, top_p=0.8, top_k=40, max_tokens=None, stop=("END",), seed=5)
    job = make_job(messages=messages, params=params, tools=(WEATHER_TOOL,), parallel_tool_calls=False,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    upstream = upstream_for(stub, api_key_env="CLAUDE_KEY", default_max_tokens=1000)
    assert "sk-ant" not in repr(upstream)
    stub.script(Reply(chunks=HELLO))
    collect(upstream, job)
    (received,) = stub.received
    assert (received.method, received.path) == ("POST", "/v1/messages")
    assert (received.headers["x-api-key"], received.headers["anthropic-version"]) == ("sk-ant-secret", "2023-06-01")
    assert received.body == {
        "model": "claude-x", "max_tokens": 1000, "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                         {"type": "text", "text": "and Rome?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [  # both results and the next question: one user turn
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "24C"},
                {"type": "text", "text": "Thanks. Which is warmer?"}]},
        ],
        "temperature": 0.3, "top_p": 0.8, "top_k": 40, "stop_sequences": ["END"],
        "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "stream": True,
    }  # the seed has no Anthropic equivalent and is dropped


def test_an_anthropic_body_round_trips_through_the_openai_job(stub):
    """An Anthropic caller reaching an Anthropic upstream: what arrives is what was sent."""
    sent = {
        "model": "served", "max_tokens": 50, "system": "Be brief.",
        "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                                         {"type": "text", "text": "Thanks."}]},
        ]}
    request = MessagesRequest.model_validate(sent)
    stub.script(Reply(chunks=HELLO))
    collect(upstream_for(stub), make_job(messages=tuple(to_chat_messages(request)), tools=tuple(to_chat_tools(request)),
                                         tool_choice="required", params=SamplingParams(max_tokens=50)))
    body = stub.received[0].body
    assert {key: body[key] for key in ("system", "messages", "tools", "tool_choice")} == {
        key: sent[key] for key in ("system", "messages", "tools", "tool_choice")}


@pytest.mark.parametrize("tool_choice, parallel, expected", [
    ("auto", True, {"type": "auto"}),
    ("required", True, {"type": "any"}),
    ("none", False, {"type": "none"}),
    ("auto", False, {"type": "auto", "disable_parallel_tool_use": True}),
    ({"type": "function", "function": {"name": "f"}}, True, {"type": "tool", "name": "f"}),
])
def test_tool_choice(tool_choice, parallel, expected):
    assert to_anthropic_tool_choice(tool_choice, parallel) == expected


@pytest.mark.parametrize("fields, param", [
    ({"kind": "completion", "messages": (), "prompt": "Once"}, "prompt"),
    ({"params": SamplingParams(logprobs=2)}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ({"role": "assistant", "content": "", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},)},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},)},
     "messages[0].content[0]"),
])
def test_what_cannot_be_translated_is_refused_before_calling(stub, fields, param):
    stub.script(Reply(chunks=HELLO))
    with pytest.raises(InvalidRequestError) as caught:
        collect(upstream_for(stub), make_job(**fields))
    assert caught.value.param == param and stub.received == []


# ---- the stream --------------------------------------------------------------------------------------


def test_text_and_parallel_tool_calls_stream_as_openai_deltas(stub):
    stub.script(Reply(chunks=(
        message_start(input_tokens=10, cache_read_input_tokens=4, cache_creation_input_tokens=2),
        anthropic_event("ping"),
        *text_block(0, "Let me ", "check."),
        *tool_block(1, "toolu_a", "get_weather", '{"ci', 'ty": "Paris"}'),
        anthropic_event("ping"),
        *tool_block(2, "toolu_b", "get_weather", '{"city": ', '"Rome"}'),
        *message_end("tool_use", output_tokens=30))))
    events = collect(upstream_for(stub), make_job(tools=(WEATHER_TOOL,)))
    assert events[:3] == [ChoiceDelta(0, text="Let me "), ChoiceDelta(0, text="check."),
                          ChoiceDelta(0, tool_calls=(ToolCallDelta(0, id="toolu_a", name="get_weather"),))]
    assert reassemble_tool_calls(events) == [
        {"id": "toolu_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": "toolu_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    # input_tokens leaves out the cached prompt; prompt_tokens includes it
    assert events[-2:] == [ChoiceDelta(0, finish_reason="tool_calls"), Usage(16, 30, cached_tokens=4)]


@pytest.mark.parametrize("stop_reason, stop_sequence, finish_reason", [
    ("end_turn", None, "stop"), ("stop_sequence", "END", "stop"), ("max_tokens", None, "length"),
    ("refusal", None, "content_filter"),
])
def test_stop_reasons(stub, stop_reason, stop_sequence, finish_reason):
    stub.script(Reply(chunks=(message_start(), *text_block(0, "x"), *message_end(stop_reason, 1, stop_sequence))))
    events = collect(upstream_for(stub), make_job())
    assert events[-2] == ChoiceDelta(0, finish_reason=finish_reason, stop_reason=stop_sequence)


def test_an_upstream_without_usage_is_counted_by_the_tokenizer(stub):
    start = anthropic_event("message_start", message={"id": "m", "type": "message", "role": "assistant",
                                                      "content": [], "model": "x"})
    stop = (anthropic_event("message_delta", delta={"stop_reason": "end_turn"}), anthropic_event("message_stop"))
    stub.script(Reply(chunks=(start, *text_block(0, "Hel", "lo"), *stop)))
    events = collect(upstream_for(stub, count_tokens=lambda job, texts: (8, len("".join(texts)))), make_job())
    assert events[-1] == Usage(8, 5, counted_by="tokenizer")


def test_n_choices_run_as_concurrent_calls_and_sum_their_usage(stub):
    stub.script(Reply(chunks=(message_start(input_tokens=10), *text_block(0, "same"), *message_end(output_tokens=3))))
    events = collect(upstream_for(stub), make_job(n=2))
    assert len(stub.received) == 2 and stub.received[0].body == stub.received[1].body
    for index in (0, 1):
        assert [event for event in events if isinstance(event, ChoiceDelta) and event.index == index] == [
            ChoiceDelta(index, text="same"), ChoiceDelta(index, finish_reason="stop")]
    assert events[-1] == Usage(20, 6)  # each call read the prompt, and is billed for it


def test_n_usages_sum_and_are_counted_by_the_least_exact_counter():
    replica, tokenizer, estimate = (Usage(10, 3, cached_tokens=2), Usage(10, 4, counted_by="tokenizer"),
                                    Usage(10, 5, counted_by="estimate"))
    assert sum_usages([replica, tokenizer, estimate]) == Usage(30, 12, cached_tokens=2, counted_by="estimate")
    assert sum_usages([tokenizer, replica]) == Usage(20, 7, cached_tokens=2, counted_by="tokenizer")
    assert sum_usages([replica, replica]) == Usage(20, 6, cached_tokens=4)


def test_one_failed_choice_fails_the_call_and_hangs_up_on_the_others(stub):
    stub.script(Reply(chunks=(message_start(), *text_block(0, "x")), then="hang"), Reply(status=500))
    with pytest.raises(BadGatewayError):
        collect(upstream_for(stub), make_job(n=2, deadline=time.monotonic() + 5))
    assert stub.wait_for(lambda: stub.num_disconnects == 1)
    assert stub.wait_for(lambda: stub.num_open_connections == 0)


# ---- failures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error, kind", [
    ({"type": "overloaded_error", "message": "Overloaded"}, ServiceUnavailableError),
    ({"type": "rate_limit_error", "message": "Slow down"}, RateLimitError),
    ({"type": "api_error", "message": "Internal server error"}, BadGatewayError),
])
def test_error_events_keep_their_kind(stub, error, kind):
    stub.script(Reply(chunks=(message_start(), *text_block(0, "x"), anthropic_event("error", error=error))))
    with pytest.raises(kind) as caught:
        collect(upstream_for(stub), make_job())
    assert anthropic_error_body(caught.value)["error"]["type"] == error["type"]  # what an Anthropic caller sees


@pytest.mark.parametrize("status, body, kind", [
    (400, b'{"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too big"}}',
     InvalidRequestError),
    (401, b'{"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}',
     BadGatewayError),
    (529, b'{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}',
     ServiceUnavailableError),
])
def test_http_errors_in_anthropics_shape(stub, status, body, kind):
    stub.script(Reply(status=status, chunks=(body,), headers={"content-type": "application/json"}))
    with pytest.raises(kind) as caught:
        collect(upstream_for(stub), make_job())
    assert type(caught.value) is kind
    assert (caught.value.message == "max_tokens: too big") is (kind is InvalidRequestError)


@pytest.mark.parametrize("reply, kind", [
    (Reply(chunks=(message_start(), *text_block(0, "x")), then="close"), BadGatewayError),
    (Reply(chunks=(message_start(), *text_block(0, "x"))), BadGatewayError),  # ends without message_stop
    (Reply(chunks=(message_start(), b"event: content_block_delta\ndata: {\"index\": 0\n\n")), BadGatewayError),
    (Reply(chunks=(message_start(), anthropic_event("content_block_delta", index=5,
                                                    delta={"type": "input_json_delta", "partial_json": "{"}))),
     BadGatewayError),  # arguments for a tool call that never started
    (Reply(chunks=(message_start(), anthropic_event("ping")), then="hang"), GatewayTimeoutError),
])
def test_broken_and_hanging_streams(stub, reply, kind):
    stub.script(reply)
    with pytest.raises(kind):
        collect(upstream_for(stub), make_job(deadline=time.monotonic() + 0.5))
    assert stub.wait_for(lambda: stub.num_open_connections == 0)


def test_aclose_mid_stream_hangs_up_on_the_upstream(stub):
    stub.script(Reply(chunks=(message_start(), *text_block(0, "one", "two")), then="hang"))

    async def main():
        async with upstream_for(stub) as upstream:
            events = upstream.generate(make_job())
            assert await anext(events) == ChoiceDelta(0, text="one")
            await events.aclose()
            return await asyncio.to_thread(stub.wait_for, lambda: stub.num_disconnects == 1)

    assert asyncio.run(main())
