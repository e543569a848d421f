"""`tokenway serve --config` as a gateway only (no local model, no engine process), in front
of an OpenAI-compatible upstream and an Anthropic one (real HTTP servers on loopback whose
answers each test scripts). The official SDKs, unchanged, cross the APIs both ways with tools
and streaming; the upstream's usage is what the ledger bills; a failing upstream opens its
breaker and the pool falls back, and the trace says so; malformed, cut and hung upstreams end
the call with an error event or a 504 within the deadline."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from ..e2e.conftest import Server
from .stub_upstream import (
    DONE,
    Reply,
    StubUpstream,
    anthropic_answer,
    anthropic_event,
    openai_answer,
    openai_chunk,
    openai_usage,
    usage_fields,
)

CONFIG = """
[[models]]
name = "gpt"
context_window = 8192
fallbacks = ["claude"]
timeout_s = 3
between_tokens_timeout_s = 1
breaker = {{failure_threshold = 3, failure_window_s = 30, cooldown_s = 1}}
health = {{interval_s = 3600}}  # no active probes: the breaker's own half-open call is tested
  [[models.replicas]]
  kind = "openai"
  name = "oa"
  url = "{openai_url}"
  model = "up-model"
  api_key_env = "TEST_UPSTREAM_KEY"

[[models]]
name = "claude"
context_window = 8192
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "anthropic"
  name = "an"
  url = "{anthropic_url}"
  model = "claude-up"

[[models]]
name = "solo"  # no fallback: its faults reach the caller
context_window = 4096
timeout_s = 3
between_tokens_timeout_s = 1
breaker = {{failure_threshold = 100}}
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "openai"
  name = "oa"
  url = "{openai_url}"
  model = "up-model"
"""

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    directory = tmp_path_factory.mktemp("upstreams")
    with StubUpstream(answer_models=True) as oa, StubUpstream(answer_models=True) as an:
        config = directory / "gateway.toml"
        config.write_text(CONFIG.format(openai_url=oa.base_url, anthropic_url=an.base_url))
        server = Server("--config", str(config), "--no-embeddings", env={"TEST_UPSTREAM_KEY": "sk-upstream-secret"})
        try:
            yield server, oa, an
        finally:
            server.stop()


@pytest.fixture(autouse=True)
def fresh_stubs(gateway):
    _, oa, an = gateway
    oa.received.clear()
    an.received.clear()


def trace_of(server, request_id: str) -> dict:
    return httpx.get(f"{server.base_url}/v1/traces/{request_id}", timeout=10).json()


def openai_tool_call_reply(arguments_pieces: tuple[str, ...]) -> Reply:
    head = openai_chunk(tool_calls=[{"index": 0, "id": "call_abc", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}])
    pieces = tuple(openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": piece}}])
                   for piece in arguments_pieces)
    return Reply(chunks=(openai_chunk(text=""), head, *pieces, openai_chunk(finish_reason="tool_calls"),
                         openai_usage(31, 9, cached_tokens=16), DONE))


def test_a_gateway_without_a_model_lists_its_upstreams_and_is_ready(gateway):
    server, _, _ = gateway
    models = {m["id"]: m for m in httpx.get(f"{server.base_url}/v1/models", timeout=5).json()["data"]}
    assert set(models) == {"gpt", "claude", "solo"} and models["gpt"]["max_model_len"] == 8192
    stats = server.stats()
    assert "kv_blocks_total" not in stats  # no engine here
    assert {name: view["kind"] for name, view in stats["replicas"]["gpt"].items()} == {"oa": "openai"}
    refused = httpx.post(f"{server.base_url}/tokenize", json={"model": "gpt", "prompt": "hi"}, timeout=5)
    assert refused.status_code == 400 and "no tokenizer" in refused.json()["error"]["message"]


def test_the_anthropic_sdk_reaches_an_openai_upstream_with_tools(gateway):
    server, oa, _ = gateway
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    oa.script(openai_answer(None, "tool_calls", usage_fields(31, 9, cached_tokens=16), tool_calls=[
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]))
    message = client.messages.create(model="gpt", max_tokens=64, tools=[WEATHER],
                                     messages=[{"role": "user", "content": "Weather in Rome?"}])
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "call_abc", "get_weather", {"city": "Rome"})
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == \
        (31 - 16, 16, 9)
    sent = oa.received[-1]
    assert sent.path == "/v1/chat/completions" and sent.headers["authorization"] == "Bearer sk-upstream-secret"
    assert sent.body["model"] == "up-model" and sent.body["max_tokens"] == 64 and "stream" not in sent.body
    assert sent.body["tools"][0]["function"]["name"] == "get_weather"
    assert sent.body["messages"] == [{"role": "user", "content": "Weather in Rome?"}]

    # The tool's result goes back as OpenAI's tool message; the answer streams as text.
    oa.script(Reply(chunks=(openai_chunk(text="Sunny"), openai_chunk(text=", 21 C."),
                            openai_chunk(finish_reason="stop"), openai_usage(48, 5), DONE)))
    with client.messages.stream(model="gpt", max_tokens=64, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_abc", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_abc", "content": "sunny, 21"}]},
    ]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Sunny, 21 C." and final.stop_reason == "end_turn" and final.usage.output_tokens == 5
    tool_message = oa.received[-1].body["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["tool_call_id"] == "call_abc"


def test_a_tool_call_streams_to_an_anthropic_client_as_it_forms(gateway):
    server, oa, _ = gateway
    oa.script(openai_tool_call_reply(('{"city"', ': "Oslo"}')))
    body = {"model": "gpt", "max_tokens": 64, "stream": True, "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    [start] = [e for e in events if e["type"] == "content_block_start"]
    assert start["content_block"] == {"type": "tool_use", "id": "call_abc", "name": "get_weather", "input": {}}
    fragments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert fragments == ['{"city"', ': "Oslo"}']  # as the upstream sent them, not buffered into one
    [stop] = [e for e in events if e["type"] == "message_delta"]
    assert stop["delta"]["stop_reason"] == "tool_use"


def test_the_openai_sdk_reaches_an_anthropic_upstream_with_tools_and_the_ledger_bills_its_usage(gateway):
    server, _, an = gateway
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    tool_stream = Reply(chunks=(
        anthropic_event("message_start", message={"id": "msg_1", "type": "message", "role": "assistant",
                                                  "content": [], "model": "claude-up",
                                                  "usage": {"input_tokens": 20, "output_tokens": 1}}),
        anthropic_event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        anthropic_event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Let me check."}),
        anthropic_event("content_block_stop", index=0),
        anthropic_event("content_block_start", index=1,
                        content_block={"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}),
        anthropic_event("content_block_delta", index=1,
                        delta={"type": "input_json_delta", "partial_json": '{"city":'}),
        anthropic_event("content_block_delta", index=1,
                        delta={"type": "input_json_delta", "partial_json": ' "Paris"}'}),
        anthropic_event("content_block_stop", index=1),
        anthropic_event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 17}),
        anthropic_event("message_stop"),
    ))
    an.script(anthropic_answer({"type": "text", "text": "Let me check."},
                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                               stop_reason="tool_use", input_tokens=20, output_tokens=17))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]
    raw = client.chat.completions.with_raw_response.create(
        model="claude", messages=[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=50)
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_1", "get_weather",
                                                                                   {"city": "Paris"})
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (20, 17)
    sent = an.received[-1].body
    assert sent["system"] == "Be brief." and sent["model"] == "claude-up" and sent["tools"][0]["name"] == "get_weather"
    row = server.ledger_row(raw.headers["x-request-id"])
    assert (row["prompt_tokens"], row["completion_tokens"], row["status"]) == (20, 17, 200)
    route = trace_of(server, raw.headers["x-request-id"])["route"]
    assert (route["pool"], route["replica"], route["reason"]) == ("claude", "an", "only")

    assert "stream" not in sent

    # Streamed: the SDK puts the call back together from its pieces.
    an.script(tool_stream)
    stream = client.chat.completions.create(model="claude", messages=[{"role": "user", "content": "Paris?"}],
                                            tools=tools, max_tokens=50, stream=True)
    pieces = [c.choices[0].delta for c in stream if c.choices]
    arguments = "".join(p.tool_calls[0].function.arguments or "" for p in pieces if p.tool_calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [p.tool_calls[0].function.name for p in pieces if p.tool_calls and p.tool_calls[0].id] == ["get_weather"]


def test_an_upstream_failing_opens_its_breaker_and_the_pool_falls_back(gateway):
    server, oa, an = gateway
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    oa.script(Reply(status=500, headers={"content-type": "application/json"},
                    chunks=(b'{"error": {"message": "boom"}}',)))
    an.script(anthropic_answer({"type": "text", "text": "from the fallback"}, input_tokens=5, output_tokens=3))
    routes = []
    for _ in range(3):  # each call fails on the upstream (a 500) before its first byte, and falls back
        raw = client.chat.completions.with_raw_response.create(
            model="gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert raw.parse().choices[0].message.content == "from the fallback"
        routes.append(trace_of(server, raw.headers["x-request-id"])["route"])
    assert all((r["pool"], r["reason"]) == ("claude", "fallback") for r in routes)
    num_upstream_calls = len(oa.received)
    assert num_upstream_calls == 3
    view = server.stats()["replicas"]["gpt"]["oa"]
    assert view["available"] is False and "breaker" in view["unavailable_reason"] and view["num_failures"] == 3

    # Open: calls go straight to the fallback, the failing upstream is not called at all.
    client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert len(oa.received) == num_upstream_calls

    # After the cooldown one call probes it; it is back, so the breaker closes.
    oa.script(openai_answer("back", usage=usage_fields(3, 1)))
    time.sleep(1.2)
    raw = client.chat.completions.with_raw_response.create(
        model="gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert raw.parse().choices[0].message.content == "back"
    assert trace_of(server, raw.headers["x-request-id"])["route"]["replica"] == "oa"
    assert server.stats()["replicas"]["gpt"]["oa"]["available"] is True


@pytest.mark.parametrize("fault", ["malformed", "closed", "hung"])
def test_a_bad_upstream_ends_a_stream_with_an_error_event_within_the_deadline(gateway, fault):
    server, oa, _ = gateway
    first = openai_chunk(text="Hel")
    replies = {"malformed": Reply(chunks=(first, b"data: {not json\n\n")),
               "closed": Reply(chunks=(first,), then="close"),
               "hung": Reply(chunks=(first,), then="hang")}
    oa.script(replies[fault])
    num_disconnects = oa.num_disconnects
    started = time.monotonic()
    body = {"model": "solo", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:2]] == ["", "Hel"]
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]", events
    assert "upstream" in error["message"].lower() or "timed out" in error["message"].lower(), error
    # The gateway's deadline (between_tokens_timeout_s = 1, timeout_s = 3) ended it, not the client's 30 s:
    # the bound is loose so that a loaded machine cannot fail it.
    assert time.monotonic() - started < 20
    if fault == "hung":
        assert oa.wait_for(lambda: oa.num_disconnects > num_disconnects)  # the gateway hung up on it
    assert server.stats()["replicas"]["solo"]["oa"]["num_in_flight"] == 0


def test_a_hung_upstream_gets_a_504_within_the_deadline(gateway):
    server, oa, _ = gateway
    oa.script(Reply(hang_before_headers=True))
    num_disconnects = oa.num_disconnects
    started = time.monotonic()
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "model": "claude-does-not-exist", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "model": "solo", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 504, response.text
    assert time.monotonic() - started < 20  # timeout_s = 3 ended it, not the client's 30 s
    assert oa.wait_for(lambda: oa.num_disconnects > num_disconnects)
    assert server.stats()["replicas"]["solo"]["oa"]["num_in_flight"] == 0  # nothing leaks


def test_a_client_that_leaves_mid_stream_aborts_the_upstream_request(gateway):
    server, oa, _ = gateway
    oa.script(Reply(chunks=(openai_chunk(text="Hel"),), then="hang"))  # more would come: it waits on the gateway
    num_disconnects = oa.num_disconnects
    body = {"model": "solo", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if '"Hel"' in line:
                break  # leave after the first text
    assert oa.wait_for(lambda: oa.num_disconnects > num_disconnects, timeout=5)  # the gateway hung up upstream
    deadline = time.monotonic() + 5
    while server.stats()["replicas"]["solo"]["oa"]["num_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["replicas"]["solo"]["oa"]["num_in_flight"] == 0


def test_a_client_that_leaves_before_a_whole_answer_aborts_the_upstream_request(gateway):
    # Not streamed: the gateway waits for one JSON answer, and hears of the client leaving from
    # its own connection (no read of the client is pending then).
    server, oa, _ = gateway
    oa.script(Reply(headers={"content-type": "application/json"}, hang_before_headers=True))
    num_disconnects = oa.num_disconnects
    body = {"model": "solo", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.5)
    left = time.monotonic()
    assert oa.wait_for(lambda: oa.num_disconnects > num_disconnects, timeout=5)
    assert time.monotonic() - left < 1.5  # the client leaving ended it, not timeout_s = 3
    deadline = time.monotonic() + 5
    while server.stats()["replicas"]["solo"]["oa"]["num_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["replicas"]["solo"]["oa"]["num_in_flight"] == 0


CUT_TEXT = ("Hello there, ", "my friend")  # 22 characters: 6 tokens by estimate_tokens, its tokenizer unknown


@pytest.mark.parametrize("upstream", ["openai", "anthropic"])
@pytest.mark.parametrize("ending", ["upstream_closes", "client_leaves"])
def test_an_upstream_stream_cut_short_bills_the_text_it_had_sent(gateway, upstream, ending):
    """The upstream reports usage only at its end: a stream cut before it (the upstream's
    connection dropped, or the client gone) is billed its prompt and what the upstream had sent."""
    server, oa, an = gateway
    then = "close" if ending == "upstream_closes" else "hang"
    if upstream == "openai":
        model, stub = "solo", oa
        stub.script(Reply(chunks=tuple(openai_chunk(text=piece) for piece in CUT_TEXT), then=then))
    else:
        model, stub = "claude", an
        stub.script(Reply(chunks=(
            anthropic_event("message_start", message={"id": "msg_1", "type": "message", "role": "assistant",
                                                      "content": [], "model": "claude-up",
                                                      "usage": {"input_tokens": 20, "output_tokens": 1}}),
            anthropic_event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            *(anthropic_event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
              for piece in CUT_TEXT)), then=then))
    body = {"model": model, "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    texts = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {") and '"choices"' in line:
                texts.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
            if "".join(texts) == "".join(CUT_TEXT) and ending == "client_leaves":
                break
    assert "".join(texts) == "".join(CUT_TEXT)
    row = server.ledger_row(request_id)
    assert row["status"] == (502 if ending == "upstream_closes" else 499), row
    assert row["completion_tokens"] == 6 and row["prompt_tokens"] > 0, row
    trace = trace_of(server, request_id)
    assert (trace["prompt_tokens"], trace["completion_tokens"]) == (row["prompt_tokens"], 6)
