"""`tokenway serve --config` as a gateway only, its models behind upstreams on loopback that
each test scripts: an OpenAI chat-completions one, an Anthropic Messages one, and one that speaks
only OpenAI's Responses API. The openai SDK's /v1/responses, streamed and not, with a function
tool's round trip through previous_response_id, reaches the first two as chat jobs; every
client API (chat completions, Anthropic Messages, Responses) reaches the third; a reasoning
model's thinking comes back in each API's shape; the upstream's usage, cached and reasoning
tokens included, is what the ledger bills."""

from __future__ import annotations

import json

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
    json_reply,
    openai_answer,
    openai_chunk,
    openai_usage,
    output_message,
    responses_event,
    responses_final,
    responses_object,
    text_item,
    usage_fields,
)

CONFIG = """
[[models]]
name = "gpt"
context_window = 8192
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "openai"
  url = "{openai_url}"
  model = "up-model"

[[models]]
name = "claude"
context_window = 8192
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "anthropic"
  url = "{anthropic_url}"
  model = "claude-up"

[[models]]
name = "next"
context_window = 8192
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "responses"
  url = "{responses_url}"
  model = "gpt-next-up"
  api_key_env = "TEST_RESPONSES_KEY"
"""

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    directory = tmp_path_factory.mktemp("responses-upstreams")
    with StubUpstream(answer_models=True) as oa, StubUpstream(answer_models=True) as an, \
            StubUpstream(answer_models=True) as rs:
        config = directory / "gateway.toml"
        config.write_text(CONFIG.format(openai_url=oa.base_url, anthropic_url=an.base_url, responses_url=rs.base_url))
        server = Server("--config", str(config), "--no-embeddings", env={"TEST_RESPONSES_KEY": "sk-next"})
        try:
            yield server, oa, an, rs
        finally:
            server.stop()


@pytest.fixture(autouse=True)
def fresh_stubs(gateway):
    for stub in gateway[1:]:
        stub.received.clear()


@pytest.fixture()
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway[0].base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_responses_reach_an_openai_chat_upstream_with_a_tool_round_trip(gateway, client):
    server, oa, _, _ = gateway
    oa.script(openai_answer(None, "tool_calls", usage_fields(31, 9, cached_tokens=16), tool_calls=[
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]))
    first = client.responses.create(model="gpt", input="Weather in Rome?", instructions="Be brief.", tools=[WEATHER],
                                    max_output_tokens=64)
    [call] = first.output
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == \
        ("function_call", "call_abc", "get_weather", {"city": "Rome"})
    assert (first.usage.input_tokens, first.usage.input_tokens_details.cached_tokens, first.usage.output_tokens) == \
        (31, 16, 9)
    sent = oa.received[-1].body
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Weather in Rome?"}]
    assert sent["tools"][0]["function"]["name"] == "get_weather" and sent["max_tokens"] == 64
    row = server.ledger_row(first.id)
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"], row["status"]) == (31, 16, 9, 200)

    # The result, through previous_response_id: the upstream is sent the whole conversation; streamed.
    oa.script(Reply(chunks=(openai_chunk(text="Sunny"), openai_chunk(text=", 21 C."),
                            openai_chunk(finish_reason="stop"), openai_usage(48, 5), DONE)))
    with client.responses.stream(model="gpt", previous_response_id=first.id, tools=[WEATHER], input=[
            {"type": "function_call_output", "call_id": "call_abc", "output": "sunny, 21"}]) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == ["Sunny", ", 21 C."] and final.output_text == "Sunny, 21 C." and final.usage.output_tokens == 5
    assert oa.received[-1].body["messages"] == [  # instructions are not carried over, as OpenAI's are not
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21"}]
    assert server.ledger_row(final.id)["completion_tokens"] == 5


def anthropic_reply(*blocks: bytes, stop_reason: str = "end_turn", output_tokens: int = 12) -> Reply:
    start = anthropic_event("message_start", message={
        "id": "m", "type": "message", "role": "assistant", "content": [], "model": "claude-up",
        "usage": {"input_tokens": 20, "output_tokens": 1, "cache_read_input_tokens": 8}})
    return Reply(chunks=(start, *blocks, anthropic_event("message_delta", delta={"stop_reason": stop_reason},
                                                         usage={"output_tokens": output_tokens}),
                         anthropic_event("message_stop")))


def anthropic_block(index: int, kind: str, *pieces: str) -> tuple[bytes, ...]:
    field = "thinking" if kind == "thinking" else "text"
    return (anthropic_event("content_block_start", index=index, content_block={"type": kind, field: ""}),
            *(anthropic_event("content_block_delta", index=index, delta={"type": f"{kind}_delta", field: piece})
              for piece in pieces),
            anthropic_event("content_block_stop", index=index))


def test_responses_reach_an_anthropic_upstream_its_thinking_a_reasoning_item(gateway, client):
    server, _, an, _ = gateway
    an.script(anthropic_reply(*anthropic_block(0, "thinking", "Two and ", "two."), *anthropic_block(1, "text", "4")))
    with client.responses.stream(model="claude", input="2+2?", reasoning={"effort": "low"},
                                 max_output_tokens=2000) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.content] == ["Two and two."]
    assert message.type == "message" and final.output_text == "4"
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert (final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens) == (28, 8)
    assert 0 < final.usage.output_tokens_details.reasoning_tokens < final.usage.output_tokens == 12
    assert an.received[-1].body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    row = server.ledger_row(final.id)
    assert (row["prompt_tokens"], row["completion_tokens"], row["reasoning_tokens"]) == \
        (28, 12, final.usage.output_tokens_details.reasoning_tokens)

    # A function tool, not streamed.
    an.script(anthropic_answer({"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                               stop_reason="tool_use", input_tokens=20, output_tokens=12))
    called = client.responses.create(model="claude", input="Weather in Oslo?", tools=[WEATHER])
    [call] = called.output
    assert (call.type, call.call_id, json.loads(call.arguments)) == ("function_call", "toolu_1", {"city": "Oslo"})
    assert an.received[-1].body["tools"][0]["name"] == "get_weather"


def test_a_responses_upstream_serves_chat_completions_with_its_thinking_and_usage(gateway, client):
    server, _, _, rs = gateway
    rs.script(json_reply(responses_object(
        {"id": "rs_0", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        output_message("Hel", "lo"), input_tokens=12, output_tokens=9, cached_tokens=4, reasoning_tokens=3)))
    raw = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "model": "next", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "medium",
        "max_tokens": 100})
    body = raw.json()
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Hello", "Hmm.")
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    sent = rs.received[-1]
    assert sent.path == "/v1/responses" and sent.headers["authorization"] == "Bearer sk-next"
    assert sent.body["reasoning"] == {"effort": "medium"} and sent.body["store"] is False
    assert "stream" not in sent.body
    row = server.ledger_row(raw.headers["x-request-id"])
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"], row["reasoning_tokens"]) == \
        (12, 4, 9, 3)


def test_a_responses_upstream_serves_the_anthropic_sdk_with_tools(gateway):
    server, _, _, rs = gateway
    rs.script(json_reply(responses_object(
        output_message("Checking."), {"id": "fc_1", "type": "function_call", "call_id": "call_9", "name": "get_weather",
                                      "arguments": '{"city": "Lima"}', "status": "completed"},
        input_tokens=30, output_tokens=11)))
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(model="next", max_tokens=64, messages=[{"role": "user", "content": "Lima?"}],
                                     tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}])
    text, use = message.content
    assert (text.text, use.type, use.id, use.input) == ("Checking.", "tool_use", "call_9", {"city": "Lima"})
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 11
    sent = rs.received[-1].body
    assert sent["tools"][0] == {"type": "function", "name": "get_weather", "parameters": WEATHER["parameters"],
                                "strict": False}
    assert sent["input"] == [{"type": "message", "role": "user", "content": "Lima?"}]


def test_a_responses_upstream_serves_responses_streamed_and_its_failure_is_an_error_event(gateway, client):
    _, _, _, rs = gateway
    rs.script(Reply(chunks=(*text_item(0, "Bonjour"), responses_final())))
    with client.responses.stream(model="next", input="Say hello in French.") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Bonjour" and final.status == "completed"

    rs.script(Reply(chunks=(*text_item(0, "Bon")[:3], responses_event(
        "response.failed", response={"id": "r", "status": "failed", "error": {"code": "server_error",
                                                                             "message": "boom"}}))))
    events = []
    with httpx.stream("POST", f"{gateway[0].base_url}/v1/responses", timeout=30,
                      json={"model": "next", "input": "hi", "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
    assert events[-2:] == ["error", "response.failed"] and "response.output_text.delta" in events
