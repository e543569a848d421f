"""A caller that did not ask for a stream: each upstream kind (OpenAI chat and completions,
Anthropic Messages, OpenAI Responses) is sent a non-streamed request against a real HTTP server
on loopback, and its one JSON answer becomes the events its stream would have given, folded
to the same result; failures map as the streamed path's do, within the same bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
    TokenwayError,
)
from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.anthropic_upstream import AnthropicUpstream
from tokenway.routing.openai_upstream import OpenAIUpstream
from tokenway.routing.responses_upstream import ResponsesUpstream
from tokenway.routing.upstream import ConnectionLimits, UpstreamTimeouts

from .stub_upstream import (
    DONE,
    Reply,
    StubUpstream,
    anthropic_event,
    call_item,
    collect,
    json_reply,
    openai_chunk,
    openai_usage,
    output_message,
    reasoning_item,
    reassemble_tool_calls,
    responses_final,
    responses_object,
    sse,
    text_item,
)
from .test_upstream_anthropic import message_end, message_start, text_block, tool_block

USER = ({"role": "user", "content": "hi"},)
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
JSON_HEADERS = {"content-type": "application/json"}


@pytest.fixture()
def stub():
    with StubUpstream() as server:
        yield server


def make_job(stream: bool = False, deadline: float | None = None, **fields) -> GenerationJob:
    fields.setdefault("messages", USER)
    fields.setdefault("params", SamplingParams(max_tokens=32))
    return GenerationJob("req-1", "served", fields.pop("kind", "chat"), stream=stream, deadline=deadline, **fields)


def fold(events: list[Any]) -> dict[str, Any]:
    """What a caller's non-streamed answer is made of: each choice's text, reasoning, tool calls,
    finish and stop reasons, then the usage."""
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, ChoiceDelta):
            choice = choices.setdefault(event.index, {"text": "", "reasoning": "", "finish_reason": None,
                                                      "stop_reason": None})
            choice["text"] += event.text
            choice["reasoning"] += event.reasoning
            choice["finish_reason"] = event.finish_reason or choice["finish_reason"]
            choice["stop_reason"] = event.stop_reason or choice["stop_reason"]
    for index, choice in choices.items():
        choice["tool_calls"] = reassemble_tool_calls(events, index)
    assert isinstance(events[-1], Usage) and sum(isinstance(event, Usage) for event in events) == 1
    return {"choices": [choices[i] for i in sorted(choices)], "usage": events[-1]}


def both_roads(stub: StubUpstream, upstream: Any, stream_reply: Reply, whole_reply: Reply,
               **job_fields: Any) -> tuple[list[Any], list[Any]]:
    """(events of the streamed call, events of the non-streamed one) for the same job."""
    stub.script(stream_reply)
    streamed = collect(upstream(), make_job(stream=True, **job_fields))
    stub.script(whole_reply)
    whole = collect(upstream(), make_job(**job_fields))
    return streamed, whole


def soon(seconds: float = 0.5) -> float:
    return time.monotonic() + seconds


# ---- OpenAI chat and completions ------------------------------------------------------------------


def openai_for(stub: StubUpstream, **options: Any) -> OpenAIUpstream:
    return OpenAIUpstream("vllm-a", stub.base_url, "upstream-model", **options)


def chat_completion(*choices: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "up", "choices": list(choices),
            "usage": usage}


USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
HELLO = chat_completion({"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"},
                        usage=USAGE)


def test_chat_is_sent_without_stream_and_answers_one_delta_and_the_usage(stub):
    stub.script(json_reply(HELLO))
    events = collect(openai_for(stub), make_job())
    assert events == [ChoiceDelta(0, text="Hello", finish_reason="stop"), Usage(7, 2, cached_tokens=4)]
    (received,) = stub.received
    assert (received.method, received.path) == ("POST", "/v1/chat/completions")
    assert received.body == {"model": "upstream-model", "messages": [{"role": "user", "content": "hi"}],
                             "temperature": 1.0, "top_p": 1.0, "max_tokens": 32}
    assert received.headers["accept"] == "application/json"


def test_chat_answers_fold_to_what_the_stream_gives(stub):
    """n = 2, reasoning, parallel tool calls, vLLM's stop_reason: the same result either way."""
    def call(index, id=None, name=None, arguments=""):
        function = {"arguments": arguments} | ({"name": name} if name else {})
        return {"index": index, **({"id": id, "type": "function"} if id else {}), "function": function}

    stream = Reply(chunks=(
        sse({"choices": [{"index": 0, "delta": {"reasoning_content": "Two cities."}, "finish_reason": None}]}),
        openai_chunk(index=1, text="I cannot"),
        openai_chunk(index=0, tool_calls=[call(0, "call_a", "get_weather", '{"city": ')]),
        openai_chunk(index=0, tool_calls=[call(0, arguments='"Paris"}'), call(1, "call_b", "get_weather",
                                                                              '{"city": "Rome"}')]),
        openai_chunk(index=1, text=" say.", finish_reason="stop", stop_reason="\n\n"),
        openai_chunk(index=0, finish_reason="tool_calls"), openai_usage(20, 30), DONE))
    whole = json_reply(chat_completion(
        {"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Rome"}'}}]}},
        {"index": 1, "finish_reason": "stop", "stop_reason": "\n\n",
         "message": {"role": "assistant", "content": "I cannot say."}},
        usage={"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50}))
    streamed, unstreamed = both_roads(stub, lambda: openai_for(stub), stream, whole, n=2, tools=(WEATHER_TOOL,))
    assert fold(unstreamed) == fold(streamed)
    assert fold(unstreamed)["choices"][0]["tool_calls"][1] == {"id": "call_b", "name": "get_weather",
                                                              "arguments": '{"city": "Rome"}'}
    assert "stream" not in stub.received[-1].body and stub.received[-1].body["n"] == 2


def test_completions_are_sent_without_stream(stub):
    stub.script(json_reply({"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": "a time", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}))
    events = collect(openai_for(stub), make_job(kind="completion", messages=(), prompt="Once upon"))
    assert events == [ChoiceDelta(0, text="a time", finish_reason="length"), Usage(2, 3)]
    assert stub.received[0].path == "/v1/completions" and "stream" not in stub.received[0].body


def test_an_answer_without_usage_is_counted_by_the_tokenizer(stub):
    stub.script(json_reply({**HELLO, "usage": None}))
    events = collect(openai_for(stub, count_tokens=lambda job, texts: (9, len(texts[0]))), make_job())
    assert events[-1] == Usage(9, 5, counted_by="tokenizer")


def test_logprobs_keep_the_stream(stub):
    """An answer with logprobs is ~1 KB a token: it comes as events, never parsed whole."""
    stub.script(Reply(chunks=(openai_chunk(text="Hi", finish_reason="stop"), openai_usage(3, 1), DONE)))
    collect(openai_for(stub), make_job(params=SamplingParams(max_tokens=8, logprobs=2)))
    assert stub.received[0].body["stream"] is True


# ---- failures, the same as the streamed path's ---------------------------------------------------


@pytest.mark.parametrize("status, body, headers", [
    (400, b'{"error": {"message": "max_tokens is too large", "param": "max_tokens", "code": "bad"}}', {}),
    (401, b'{"error": {"message": "Incorrect API key provided: sk-sec***123"}}', {}),
    (404, b'{"error": {"message": "model upstream-model does not exist"}}', {}),
    (429, b"slow down", {"retry-after-ms": "1500"}),
    (500, b"Internal Server Error", {}),
    (503, b"overloaded", {"retry-after": "3"}),
])
def test_statuses_map_as_the_streamed_path_maps_them(stub, status, body, headers):
    def failure(stream: bool) -> TokenwayError:
        stub.script(Reply(status=status, chunks=(body,), headers=JSON_HEADERS | headers))
        with pytest.raises(TokenwayError) as caught:
            collect(openai_for(stub), make_job(stream=stream, deadline=soon(5)))
        return caught.value

    streamed, unstreamed = failure(True), failure(False)
    assert type(unstreamed) is type(streamed)
    assert (unstreamed.message, unstreamed.param, unstreamed.code, unstreamed.retry_after) == (
        streamed.message, streamed.param, streamed.code, streamed.retry_after)
    assert "sk-sec" not in unstreamed.message


def test_an_error_object_in_a_200_answer_keeps_its_kind(stub):
    stub.script(json_reply({"error": {"message": "prompt is too long", "code": 400}}))
    with pytest.raises(InvalidRequestError, match="prompt is too long"):
        collect(openai_for(stub), make_job())


@pytest.mark.parametrize("reply", [
    Reply(chunks=(b'{"choices": [{"index": 0, "message"',), headers=JSON_HEADERS),  # truncated JSON
    Reply(chunks=(b"<html>502 Bad Gateway</html>",), headers={"content-type": "text/html"}),
    Reply(chunks=(b"[1, 2]",), headers=JSON_HEADERS),  # JSON, but no object
    Reply(chunks=(b'{"choices": []}\xff',), headers=JSON_HEADERS),  # not UTF-8
    Reply(chunks=(openai_chunk(text="ok", finish_reason="stop"), DONE)),  # an event stream, unasked
    Reply(chunks=(b'{"choices": [',), headers=JSON_HEADERS | {"content-length": "400"}, then="close"),  # cut off
    json_reply(chat_completion({"index": 0, "message": {"content": "ok"}, "finish_reason": None})),  # never finished
    json_reply(chat_completion({"index": 3, "message": {"content": "?"}, "finish_reason": "stop"})),  # not asked for
    json_reply(chat_completion({"index": 0, "message": {"content": 7}, "finish_reason": "stop"})),  # malformed
])
def test_garbage_and_broken_answers_are_bad_gateway(stub, reply):
    stub.script(reply)
    with pytest.raises(BadGatewayError):
        collect(openai_for(stub), make_job(deadline=soon(5)))


def test_an_answer_over_max_answer_bytes_is_bad_gateway_and_its_connection_dropped(stub):
    stub.script(json_reply(chat_completion({"index": 0, "message": {"content": "x" * 5000}, "finish_reason": "stop"})))
    with pytest.raises(BadGatewayError, match="max_answer_bytes"):
        collect(openai_for(stub, limits=ConnectionLimits(max_answer_bytes=4096)), make_job())
    assert stub.wait_for(lambda: stub.num_open_connections == 0)


def test_a_hanging_upstream_is_a_gateway_timeout_at_the_deadline_and_is_hung_up_on(stub):
    stub.script(Reply(hang_before_headers=True))
    with pytest.raises(GatewayTimeoutError, match="before the request's deadline"):
        collect(openai_for(stub), make_job(deadline=soon(0.5)))
    assert stub.wait_for(lambda: stub.num_disconnects == 1)


def test_without_a_deadline_the_wait_ends_at_whole_answer(stub):
    """between_events would end a stream's silence sooner; a non-streamed answer is one long
    silence, bounded by whole_answer alone."""
    stub.script(Reply(chunks=(b'{"choices": [',), headers=JSON_HEADERS | {"content-length": "400"}, then="hang"))
    timeouts = UpstreamTimeouts(first_event=0.1, between_events=0.1, whole_answer=0.6)
    with pytest.raises(GatewayTimeoutError, match="did not answer in time"):
        collect(openai_for(stub, timeouts=timeouts), make_job())
    assert stub.wait_for(lambda: stub.num_disconnects == 1)


def test_cancelling_the_caller_hangs_up_on_the_upstream(stub):
    stub.script(Reply(hang_before_headers=True))

    async def main():
        async with openai_for(stub) as upstream:
            task = asyncio.create_task(anext(upstream.generate(make_job())))
            await asyncio.to_thread(stub.wait_for, lambda: len(stub.received) == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.to_thread(stub.wait_for, lambda: stub.num_disconnects == 1)

    assert asyncio.run(main())


def test_calls_in_a_row_and_after_failures_reuse_one_connection(stub):
    stub.script(json_reply({"error": {"message": "nope", "code": 400}}, status=400), json_reply(HELLO))

    async def main():
        async with openai_for(stub, limits=ConnectionLimits(max_connections=1)) as upstream:
            with pytest.raises(InvalidRequestError):
                [event async for event in upstream.generate(make_job())]
            for _ in range(3):
                assert [event async for event in upstream.generate(make_job())][-1] == Usage(7, 2, cached_tokens=4)

    asyncio.run(main())
    assert len({received.client_port for received in stub.received}) == 1


def test_a_passed_deadline_fails_without_calling():
    with pytest.raises(GatewayTimeoutError):
        collect(OpenAIUpstream("gone", "http://127.0.0.1:9/v1", "m"), make_job(deadline=time.monotonic() - 1))



# ---- Anthropic Messages -----------------------------------------------------------------------------


def anthropic_for(stub: StubUpstream, **options: Any) -> AnthropicUpstream:
    return AnthropicUpstream("claude", stub.base_url, "claude-x", **options)


def anthropic_message(*content: dict[str, Any], stop_reason: str | None = "end_turn",
                      stop_sequence: str | None = None, **usage: int) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": list(content),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": 10, "output_tokens": 5} | usage}


def test_a_message_is_sent_without_stream_and_folds_to_what_the_stream_gives(stub):
    """Thinking, text in two blocks, two tool calls, the cache's tokens: the same result either way."""
    stream = Reply(chunks=(
        message_start(4, cache_read_input_tokens=30),
        anthropic_event("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}),
        anthropic_event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Two."}),
        anthropic_event("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "sig"}),
        anthropic_event("content_block_stop", index=0),
        *text_block(1, "Check", "ing."), *tool_block(2, "toolu_1", "get_weather", '{"city":', ' "Paris"}'),
        *text_block(3, " And"), *tool_block(4, "toolu_2", "get_weather", '{"city": "Rome"}'),
        *message_end("tool_use", output_tokens=40)))
    whole = json_reply(anthropic_message(
        {"type": "thinking", "thinking": "Two.", "signature": "sig"}, {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "text", "text": " And"},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
        {"type": "redacted_thinking", "data": "opaque"},
        stop_reason="tool_use", input_tokens=4, output_tokens=40, cache_read_input_tokens=30))
    streamed, unstreamed = both_roads(stub, lambda: anthropic_for(stub), stream, whole, tools=(WEATHER_TOOL,))
    assert fold(unstreamed) == fold(streamed)
    assert fold(unstreamed)["usage"] == Usage(34, 40, cached_tokens=30)
    assert fold(unstreamed)["choices"][0] | {"tool_calls": None} == {
        "text": "Checking. And", "reasoning": "Two.", "finish_reason": "tool_calls", "stop_reason": None,
        "tool_calls": None}
    assert stub.received[0].body["stream"] is True and "stream" not in stub.received[1].body
    assert stub.received[1].headers["accept"] == "application/json"


def test_n_messages_are_n_calls_and_a_stop_sequence_is_the_stop_reason(stub):
    stub.script(json_reply(anthropic_message({"type": "text", "text": "A"}, stop_reason="stop_sequence",
                                             stop_sequence="END")))
    events = collect(anthropic_for(stub), make_job(n=2))
    assert sorted(events[:2], key=lambda delta: delta.index) == [
        ChoiceDelta(0, text="A", finish_reason="stop", stop_reason="END"),
        ChoiceDelta(1, text="A", finish_reason="stop", stop_reason="END")]
    assert events[2:] == [Usage(20, 10)] and len(stub.received) == 2


@pytest.mark.parametrize("reply, kind", [
    (Reply(status=529, chunks=(b'{"type": "error", "error": {"type": "overloaded_error"}}',), headers=JSON_HEADERS),
     ServiceUnavailableError),
    (json_reply({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
     ServiceUnavailableError),
    (json_reply({"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}}),
     InvalidRequestError),
    (json_reply(anthropic_message({"type": "text", "text": "cut"}, stop_reason=None)), BadGatewayError),
    (json_reply({**anthropic_message(), "content": "not blocks"}), BadGatewayError),
    (json_reply({"type": "message"}), BadGatewayError),
])
def test_a_failed_or_broken_message_maps_as_its_stream_would(stub, reply, kind):
    stub.script(reply)
    with pytest.raises(kind):
        collect(anthropic_for(stub), make_job(deadline=soon(5)))


# ---- OpenAI Responses ------------------------------------------------------------------------------


def responses_for(stub: StubUpstream) -> ResponsesUpstream:
    return ResponsesUpstream("gpt-next", stub.base_url, "gpt-up")


def test_a_response_is_sent_without_stream_and_folds_to_what_the_stream_gives(stub):
    """Reasoning (its text and its summary), text, two tool calls, the usage: the same result either way."""
    stream = Reply(chunks=(
        *reasoning_item(0, "reasoning_text", "Rome and ", "Paris."), *reasoning_item(1, "reasoning_summary_text", "!"),
        *text_item(2, "Let me ", "check."), *call_item(3, "call_a", '{"ci', 'ty": "Rome"}'),
        *call_item(4, "call_b", '{"city": "Paris"}'),
        responses_final(input_tokens=40, output_tokens=30, cached_tokens=32, reasoning_tokens=12)))
    whole = json_reply(responses_object(
        {"id": "rs_0", "type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Rome and Paris."}]},
        {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "!"}]},
        output_message("Let me ", "check."),
        {"id": "fc_3", "type": "function_call", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Rome"}', "status": "completed"},
        {"id": "fc_4", "type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        input_tokens=40, output_tokens=30, cached_tokens=32, reasoning_tokens=12))
    streamed, unstreamed = both_roads(stub, lambda: responses_for(stub), stream, whole, tools=(WEATHER_TOOL,))
    assert fold(unstreamed) == fold(streamed)
    assert fold(unstreamed)["choices"][0]["reasoning"] == "Rome and Paris.!"
    assert fold(unstreamed)["choices"][0]["finish_reason"] == "tool_calls"
    assert fold(unstreamed)["usage"] == Usage(40, 30, cached_tokens=32, reasoning_tokens=12)
    assert stub.received[0].body["stream"] is True and "stream" not in stub.received[1].body
    assert stub.received[1].body["store"] is False


def test_an_incomplete_response_and_a_refusal_end_as_the_stream_would(stub):
    stub.script(json_reply(responses_object({"id": "msg_1", "type": "message", "role": "assistant", "content": [
        {"type": "refusal", "refusal": "I can't."}]}, status="incomplete", incomplete_reason="content_filter")))
    events = collect(responses_for(stub), make_job(n=2))
    assert sorted(events[:2], key=lambda delta: delta.index) == [
        ChoiceDelta(0, text="I can't.", finish_reason="content_filter"),
        ChoiceDelta(1, text="I can't.", finish_reason="content_filter")]
    assert events[2:] == [Usage(20, 10)] and len(stub.received) == 2


@pytest.mark.parametrize("reply, kind", [
    (json_reply(responses_object() | {"status": "failed", "error": {"code": "rate_limit_exceeded", "message": "slow"}}),
     RateLimitError),
    (json_reply(responses_object() | {"status": "failed", "error": {"code": "server_error", "message": "oops"}}),
     BadGatewayError),
    (json_reply({"error": {"type": "invalid_request_error", "message": "bad input", "code": None}}),
     InvalidRequestError),
    (Reply(status=429, chunks=(b'{"error": {"message": "slow"}}',), headers=JSON_HEADERS), RateLimitError),
    (json_reply({**responses_object(), "output": [{"type": "message", "content": [{"type": "output_text"}]}]}),
     BadGatewayError),
    (json_reply({"object": "response", "status": "completed"}), BadGatewayError),
])
def test_a_failed_or_broken_response_maps_as_its_stream_would(stub, reply, kind):
    stub.script(reply)
    with pytest.raises(kind):
        collect(responses_for(stub), make_job(deadline=soon(5)))
