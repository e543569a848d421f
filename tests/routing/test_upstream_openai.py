"""OpenAIUpstream against a real HTTP server on loopback: the exact body it sends, the events
it yields, every failure mapped to its error kind within the deadline, disconnects seen by the
upstream, no connection left open. Also upstream.py's shared pieces: the SSE decoder, the
error table, is_replica_fault."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from tokenway.protocol.anthropic import MessagesRequest, to_chat_messages, to_chat_tools
from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
)
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ToolCallDelta, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.openai_upstream import OpenAIUpstream
from tokenway.routing.sse_decoder import SSEDecoder, SSEEvent
from tokenway.routing.upstream import (
    ConnectionLimits,
    UpstreamTimeouts,
)
from tokenway.routing.upstream_errors import error_for_status, is_replica_fault

from .stub_upstream import DONE, Reply, StubUpstream, collect, openai_chunk, openai_usage, reassemble_tool_calls, sse

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


def soon(seconds: float = 0.5) -> float:
    return time.monotonic() + seconds


def upstream_for(stub: StubUpstream, **options) -> OpenAIUpstream:
    return OpenAIUpstream("vllm-a", stub.base_url, "upstream-model", **options)


def test_an_upstream_is_a_replica_that_publishes_no_engine_stats(stub):
    assert upstream_for(stub).stats() is None


HELLO = (openai_chunk(text=""), openai_chunk(text="Hel"), openai_chunk(text="lo", finish_reason="stop"),
         openai_usage(7, 2, cached_tokens=4), DONE)


# ---- bodies ----------------------------------------------------------------------------------------


def test_streams_text_and_the_upstreams_usage(stub):
    stub.script(Reply(chunks=HELLO))
    events = collect(upstream_for(stub), make_job())
    assert events == [ChoiceDelta(0, text="Hel"), ChoiceDelta(0, text="lo", finish_reason="stop"),
                      Usage(7, 2, cached_tokens=4, counted_by="replica")]
    (received,) = stub.received
    assert (received.method, received.path) == ("POST", "/v1/chat/completions")
    assert received.body == {"model": "upstream-model", "messages": [{"role": "user", "content": "hi"}],
                             "temperature": 1.0, "top_p": 1.0, "max_tokens": 32,
                             "stream": True, "stream_options": {"include_usage": True}}
    assert received.headers["accept-encoding"] == "identity"  # a compressed stream would arrive in batches


def test_chat_body_carries_tools_tool_results_and_every_sampling_field(stub, monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", "sk-secret-123")
    stub.script(Reply(chunks=(openai_chunk(index=0, finish_reason="stop"), openai_chunk(index=1, finish_reason="stop"),
                              DONE)))
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
    )
    params = SamplingParams(temperature=0.2, top_p=0.9, max_tokens=64, stop=("\n\n",), seed=11, presence_penalty=0.5,
                            frequency_penalty=-0.5, logit_bias={42: -100}, logprobs=3, top_k=20)
    job = make_job(messages=messages, params=params, n=2, tools=(WEATHER_TOOL,), parallel_tool_calls=False,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   response_format={"type": "json_object"})
    upstream = upstream_for(stub, api_key_env="UPSTREAM_KEY")
    assert "sk-secret" not in repr(upstream)
    collect(upstream, job)
    (received,) = stub.received
    assert received.headers["authorization"] == "Bearer sk-secret-123"
    assert received.body == {
        "model": "upstream-model", "messages": [dict(m) for m in messages], "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_object"}, "temperature": 0.2, "top_p": 0.9, "max_tokens": 64,
        "stop": ["\n\n"], "seed": 11, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": -100.0},
        "n": 2, "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
    }  # top_k is not OpenAI's: sent only with sampling_extensions


def test_sampling_extensions_add_the_vllm_fields(stub):
    stub.script(Reply(chunks=HELLO))
    collect(upstream_for(stub, sampling_extensions=True),
            make_job(params=SamplingParams(max_tokens=8, top_k=20, min_p=0.05, repetition_penalty=1.1)))
    body = stub.received[0].body
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (20, 0.05, 1.1)
    assert "min_tokens" not in body


def test_an_anthropic_callers_conversation_reaches_an_openai_upstream(stub):
    request = MessagesRequest.model_validate({
        "model": "served", "max_tokens": 50, "system": "Be brief.",
        "tools": [{"name": "get_weather", "description": "Weather in a city",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]},
        ]})
    stub.script(Reply(chunks=HELLO))
    collect(upstream_for(stub), make_job(messages=tuple(to_chat_messages(request)), tools=tuple(to_chat_tools(request)),
                                         params=SamplingParams(max_tokens=request.max_tokens)))
    body = stub.received[0].body
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
    ]
    assert body["tools"] == [WEATHER_TOOL] and body["tool_choice"] == "auto"


@pytest.mark.parametrize("prompt, token_ids, sent", [("Once upon", None, "Once upon"), (None, (5, 6, 7), [5, 6, 7])])
def test_completion_jobs_go_to_completions(stub, prompt, token_ids, sent):
    stub.script(Reply(chunks=(sse({"choices": [{"index": 0, "text": "a time", "finish_reason": None}]}),
                              sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
                              openai_usage(2, 3), DONE)))
    events = collect(upstream_for(stub), make_job(kind="completion", messages=(), prompt=prompt,
                                                  prompt_token_ids=token_ids))
    assert events == [ChoiceDelta(0, text="a time"), ChoiceDelta(0, finish_reason="length"), Usage(2, 3)]
    assert stub.received[0].path == "/v1/completions"
    assert stub.received[0].body["prompt"] == sent


# ---- events ---------------------------------------------------------------------------------------------


def test_parallel_tool_calls_split_across_chunks_reassemble_exactly(stub):
    def call(index, id=None, name=None, arguments=""):
        function = {"arguments": arguments} | ({"name": name} if name else {})
        return {"index": index, **({"id": id, "type": "function"} if id else {}), "function": function}

    stub.script(Reply(chunks=(
        openai_chunk(tool_calls=[call(0, "call_a", "get_weather")]),
        openai_chunk(tool_calls=[call(0, arguments='{"ci')]),
        openai_chunk(tool_calls=[call(0, arguments='ty": "Paris"}')]),
        openai_chunk(tool_calls=[call(1, "call_b", "get_weather", '{"city"')]),
        openai_chunk(tool_calls=[call(1, arguments=': "Rome"}')]),
        openai_chunk(finish_reason="tool_calls"), openai_usage(20, 18), DONE)))
    events = collect(upstream_for(stub), make_job(tools=(WEATHER_TOOL,)))
    assert events[0] == ChoiceDelta(0, tool_calls=(ToolCallDelta(0, id="call_a", name="get_weather"),))
    assert reassemble_tool_calls(events) == [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    assert events[-2:] == [ChoiceDelta(0, finish_reason="tool_calls"), Usage(20, 18)]


def test_n_choices_interleaved_keep_their_index(stub):
    stub.script(Reply(chunks=(openai_chunk(index=1, text="B"), openai_chunk(index=0, text="A"),
                              openai_chunk(index=0, finish_reason="stop"),
                              openai_chunk(index=1, finish_reason="length"),
                              openai_usage(5, 2), DONE)))
    events = collect(upstream_for(stub), make_job(n=2))
    assert events == [ChoiceDelta(1, text="B"), ChoiceDelta(0, text="A"), ChoiceDelta(0, finish_reason="stop"),
                      ChoiceDelta(1, finish_reason="length"), Usage(5, 2)]


def test_logprobs_and_vllms_stop_reason_are_passed_on(stub):
    entry = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [{"token": "Hi", "logprob": -0.1}]}
    stub.script(Reply(chunks=(openai_chunk(text="Hi", logprobs={"content": [entry]}),
                              openai_chunk(finish_reason="stop", stop_reason="\n\n"), openai_usage(3, 1), DONE)))
    events = collect(upstream_for(stub), make_job(params=SamplingParams(max_tokens=8, logprobs=1)))
    assert events[:2] == [ChoiceDelta(0, text="Hi", logprobs=(entry,)),
                          ChoiceDelta(0, finish_reason="stop", stop_reason="\n\n")]


def test_an_upstream_without_usage_is_counted_by_the_tokenizer(stub):
    stub.script(Reply(chunks=HELLO[:3] + (DONE,)))
    seen = []

    def count_tokens(job, completion_texts):
        seen.append((job.request_id, list(completion_texts)))
        return 9, 2

    events = collect(upstream_for(stub, count_tokens=count_tokens), make_job())
    assert events[-1] == Usage(9, 2, counted_by="tokenizer")
    assert seen == [("req-1", ["Hello"])]


def test_without_usage_or_tokenizer_the_estimate_is_a_quarter_of_the_characters(stub):
    stub.script(Reply(chunks=(openai_chunk(text="x" * 10, finish_reason="stop"), DONE)))
    events = collect(upstream_for(stub), make_job(prompt_token_ids=tuple(range(13))))
    assert events[-1] == Usage(13, 3, counted_by="estimate")  # the templated prompt's ids; ceil(10 / 4)


def test_the_first_event_arrives_before_the_upstream_sends_the_rest(stub):
    gate = threading.Event()
    stub.script(Reply(chunks=(openai_chunk(text="first"), gate, openai_chunk(text="!", finish_reason="stop"), DONE)))

    async def main():
        async with upstream_for(stub) as upstream:
            events = upstream.generate(make_job())
            first = await anext(events)
            gate.set()  # only now may the stub send the rest
            return first, [event async for event in events]

    first, rest = asyncio.run(main())
    assert first == ChoiceDelta(0, text="first")
    assert rest[0] == ChoiceDelta(0, text="!", finish_reason="stop")


# ---- failures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, body, headers, kind, retry_after", [
    (400, b'{"error": {"message": "max_tokens is too large", "param": "max_tokens", "code": "bad"}}', {},
     InvalidRequestError, None),
    (422, b'{"detail": "prompt must not be empty"}', {}, InvalidRequestError, None),
    (401, b'{"error": {"message": "Incorrect API key provided: sk-sec***123"}}', {}, BadGatewayError, None),
    (403, b"forbidden", {}, BadGatewayError, None),
    (404, b'{"error": {"message": "model upstream-model does not exist"}}', {}, BadGatewayError, None),
    (429, b"slow down", {"retry-after-ms": "1500", "retry-after": "2"}, RateLimitError, 1.5),
    (429, b"slow down", {"retry-after": "7"}, RateLimitError, 7.0),
    (500, b"Internal Server Error", {}, BadGatewayError, None),
    (502, b"<html>bad gateway</html>", {}, BadGatewayError, None),
    (503, b"overloaded", {"retry-after": "3"}, ServiceUnavailableError, 3.0),
])
def test_upstream_statuses_map_to_the_error_tree(stub, status, body, headers, kind, retry_after):
    stub.script(Reply(status=status, chunks=(body,), headers={"content-type": "application/json", **headers}))
    with pytest.raises(kind) as caught:
        collect(upstream_for(stub), make_job(deadline=soon(5)))
    assert type(caught.value) is kind and caught.value.retry_after == retry_after
    if kind is InvalidRequestError:  # the caller's fault: the upstream's own words
        assert caught.value.message in ("max_tokens is too large", "prompt must not be empty")
    else:  # never the upstream's text: it may quote the key
        assert "sk-sec" not in caught.value.message and "does not exist" not in caught.value.message
    assert is_replica_fault(caught.value) is (kind is not InvalidRequestError)


def test_a_400_passes_the_upstreams_param_and_code():
    error = error_for_status("a", 400, b'{"error": {"message": "too long", "param": "messages", '
                                       b'"code": "context_length_exceeded"}}', {})
    assert (error.message, error.param, error.code) == ("too long", "messages", "context_length_exceeded")


@pytest.mark.parametrize("chunks, then", [
    ((openai_chunk(text="ok"), b'data: {"choices": [{"index": 0, "delta"\n\n'), "end"),  # truncated JSON
    ((b"<html><body>502 Bad Gateway</body></html>\n",), "end"),  # not an event stream at all
    ((openai_chunk(text="ok"), b"data: [1, 2]\n\n"), "end"),  # JSON, but no object
    ((openai_chunk(text="ok"), b"data: \xff\xfe\n\n"), "end"),  # not UTF-8
    ((openai_chunk(text="ok"),), "close"),  # connection dropped mid-stream
    ((openai_chunk(text="ok"), openai_usage(1, 1)), "end"),  # a clean end, but the choice never finished
    ((openai_chunk(text="ok"), openai_chunk(index=3, text="?")), "end"),  # a choice that was not asked for
])
def test_garbage_and_broken_streams_are_bad_gateway(stub, chunks, then):
    stub.script(Reply(chunks=chunks, then=then))
    with pytest.raises(BadGatewayError):
        collect(upstream_for(stub), make_job(deadline=soon(5)))


def test_an_error_inside_the_stream_keeps_its_kind(stub):
    stub.script(Reply(chunks=(openai_chunk(text="ok"), sse({"error": {"message": "prompt is too long", "code": 400}}))))
    with pytest.raises(InvalidRequestError, match="prompt is too long"):
        collect(upstream_for(stub), make_job())


@pytest.mark.parametrize("reply", [
    Reply(hang_before_headers=True),  # accepts the connection, never answers
    Reply(chunks=(openai_chunk(text="ok"),), then="hang"),  # starts, then goes quiet
    Reply(chunks=(b": keep-alive\n\n",) * 3, then="hang"),  # comments only, then silence
])
def test_a_hanging_upstream_is_a_gateway_timeout_and_is_hung_up_on(stub, reply):
    stub.script(reply)
    with pytest.raises(GatewayTimeoutError, match="before the request's deadline"):
        collect(upstream_for(stub), make_job(deadline=soon(0.5)))
    assert stub.wait_for(lambda: stub.num_disconnects == 1)
    assert is_replica_fault(GatewayTimeoutError("x"))


def test_silence_between_events_times_out_without_a_deadline(stub):
    stub.script(Reply(chunks=(openai_chunk(text="ok"),), then="hang"))
    with pytest.raises(GatewayTimeoutError, match="did not answer in time"):
        collect(upstream_for(stub, timeouts=UpstreamTimeouts(between_events=0.3)), make_job(deadline=None))


def test_a_passed_deadline_fails_without_calling():
    upstream = OpenAIUpstream("gone", "http://127.0.0.1:9/v1", "m")
    with pytest.raises(GatewayTimeoutError):
        collect(upstream, make_job(deadline=time.monotonic() - 1))


def test_a_refused_connection_is_bad_gateway():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BadGatewayError) as caught:
        collect(OpenAIUpstream("down", f"http://127.0.0.1:{port}/v1", "m"), make_job(deadline=soon(5)))
    assert is_replica_fault(caught.value)


# ---- disconnects and leaks -----------------------------------------------------------------------------


def test_aclose_mid_stream_hangs_up_on_the_upstream(stub):
    stub.script(Reply(chunks=(openai_chunk(text="one"), openai_chunk(text="two")), then="hang"))

    async def main():
        async with upstream_for(stub) as upstream:
            events = upstream.generate(make_job())
            assert await anext(events) == ChoiceDelta(0, text="one")
            await events.aclose()
            return await asyncio.to_thread(stub.wait_for, lambda: stub.num_disconnects == 1)

    assert asyncio.run(main())


def test_cancelling_the_consumer_hangs_up_on_the_upstream(stub):
    stub.script(Reply(chunks=(openai_chunk(text="one"),), then="hang"))

    async def main():
        async with upstream_for(stub) as upstream:
            first = asyncio.Event()

            async def consume():
                async for _ in upstream.generate(make_job()):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.to_thread(stub.wait_for, lambda: stub.num_disconnects == 1)

    assert asyncio.run(main())


def test_calls_in_a_row_reuse_one_connection(stub):
    stub.script(Reply(chunks=HELLO))

    async def main():
        async with upstream_for(stub) as upstream:
            for _ in range(3):
                assert [event async for event in upstream.generate(make_job())][-1] == Usage(7, 2, cached_tokens=4)

    asyncio.run(main())
    assert len({received.client_port for received in stub.received}) == 1


def test_many_failing_calls_leak_no_connection(stub):
    failures = [Reply(status=500, chunks=(b"boom",)), Reply(chunks=(b"data: {oops\n\n",)),
                Reply(chunks=(openai_chunk(text="x"),), then="close"), Reply(hang_before_headers=True),
                Reply(chunks=(openai_chunk(text="x"),), then="hang"), Reply(status=429, chunks=(b"{}",))]
    stub.script(*(failures * 4), Reply(chunks=HELLO))

    async def main():
        # Two connections at most: a leaked one would starve the calls after it (and the last one).
        upstream = upstream_for(stub, limits=ConnectionLimits(max_connections=2, max_keepalive_connections=1))
        async with upstream:
            for _ in range(len(failures) * 4):
                with pytest.raises((BadGatewayError, GatewayTimeoutError, RateLimitError)):
                    async for _ in upstream.generate(make_job(deadline=soon(0.3))):
                        pass
            events = [event async for event in upstream.generate(make_job(deadline=soon(5)))]
            at_most_one = await asyncio.to_thread(stub.wait_for, lambda: stub.num_open_connections <= 1)
            return events, at_most_one

    events, at_most_one = asyncio.run(main())
    assert events[-1] == Usage(7, 2, cached_tokens=4)
    assert at_most_one  # only the one kept alive for reuse
    assert stub.wait_for(lambda: stub.num_open_connections == 0)  # and that one closed with the upstream


# ---- probe ---------------------------------------------------------------------------------------------


def test_probe_gets_models_and_maps_failures(stub, monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", "sk-probe")

    async def probe(**options):
        async with upstream_for(stub, api_key_env="UPSTREAM_KEY", **options) as upstream:
            return await upstream.probe()

    stub.script(Reply(chunks=(b'{"object": "list", "data": []}',), headers={"content-type": "application/json"}))
    assert asyncio.run(probe()) is True
    assert (stub.received[0].method, stub.received[0].path) == ("GET", "/v1/models")
    assert stub.received[0].headers["authorization"] == "Bearer sk-probe"
    stub.script(Reply(status=401))
    with pytest.raises(BadGatewayError):
        asyncio.run(probe())
    stub.script(Reply(hang_before_headers=True))
    with pytest.raises(GatewayTimeoutError):
        asyncio.run(probe(timeouts=UpstreamTimeouts(probe=0.3)))
    stub.script(Reply(chunks=(b"ok",)))
    asyncio.run(probe(health_path="/health"))
    assert stub.received[-1].path == "/v1/health"


def test_an_unset_key_variable_is_a_config_error(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_KEY"):
        OpenAIUpstream("a", "http://127.0.0.1:1/v1", "m", api_key_env="NO_SUCH_KEY")


# ---- the SSE decoder ---------------------------------------------------------------------------------


def decode(*pieces: str) -> list[SSEEvent]:
    decoder = SSEDecoder()
    return [event for piece in pieces for event in decoder.feed(piece)] + decoder.finish()


def test_sse_line_ends_comments_and_multiline_data():
    assert decode("\ufeffdata: a\r\n\r\n", ": comment\n", "event: ping\ndata: b\ndata:c\n\n") == [
        SSEEvent("a"), SSEEvent("b\nc", event="ping")]
    # A CRLF split across chunks is one line end, not two (which would end the event early).
    assert decode("data: x\r", "\ndata: y\r", "\n\r\n") == [SSEEvent("x\ny")]
    assert decode("data: one\r\rdata: two\r\r") == [SSEEvent("one"), SSEEvent("two")]
    assert decode("id: 1\nretry: 10\ndata: z\n\n") == [SSEEvent("z")]
    assert decode("data: last") == [SSEEvent("last")]  # the body ended before its blank line
    assert decode("data: a\u2028b\n\n") == [SSEEvent("a\u2028b")]  # JSON may hold U+2028 unescaped


def test_sse_rejects_what_is_not_an_event_stream():
    with pytest.raises(ValueError, match="not an event-stream line"):
        decode('{"id": "chatcmpl-1"}\n')
    with pytest.raises(ValueError, match="larger than"):
        SSEDecoder(max_event_chars=10).feed("data: " + "x" * 20 + "\n")


def test_is_replica_fault_spares_the_callers_mistakes():
    assert not is_replica_fault(InvalidRequestError("bad"))
    assert not is_replica_fault(asyncio.CancelledError())
    assert all(is_replica_fault(error) for error in (BadGatewayError("x"), GatewayTimeoutError("x"),
                                                     ServiceUnavailableError("x"), RateLimitError("x")))
