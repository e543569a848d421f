"""The anthropic SDK against a real server, every field of the current Messages reference set:
no 400 for a field the real API takes, a clear Anthropic-shaped 400 for a value this server
cannot honour, count_tokens equal to the call's prompt, and usage split at the cache breakpoint
as Anthropic splits it."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import pytest

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    # Several betas named, as agent clients name them: every Anthropic route takes any.
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120,
                               default_headers={"anthropic-beta": "context-management-2025-06-27,"
                                                                  "interleaved-thinking-2025-05-14"})


def nonce() -> str:
    """A prompt start no earlier call shares, so that nothing of it is in the prefix cache."""
    return f"Session {uuid.uuid4().hex}."


def test_every_field_in_one_request(client):
    message = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY,
        system=[{"type": "text", "text": "You answer in one short sentence.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
            {"type": "document", "title": "Facts", "source": {"type": "text", "media_type": "text/plain",
                                                             "data": "The capital of France is Paris."}},
            {"type": "search_result", "source": "https://example.com", "title": "France",
             "content": [{"type": "text", "text": "Paris is the capital."}]},
            {"type": "text", "text": "What is the capital of France?", "cache_control": {"type": "ephemeral"}}]}],
        tools=[WEATHER, {"type": "bash_20250124", "name": "bash"},
               {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
               {"type": "memory_20250818", "name": "memory"}],
        tool_choice={"type": "none"}, thinking={"type": "disabled"}, output_config={"effort": "low"},
        cache_control={"type": "ephemeral", "ttl": "1h"}, container="container_1",
        diagnostics={"previous_message_id": None}, inference_geo="us", metadata={"user_id": "u1"},
        service_tier="auto", speed="fast", stop_sequences=["\n\n\n"], user_profile_id="up_1")
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence") and message.content[0].type == "text"
    usage = message.usage
    assert (usage.service_tier, usage.speed) == ("standard", "standard")
    # The breakpoint is the last block: the prompt up to it was written, under the ttl asked.
    assert usage.cache_creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens > 0


def test_the_betas_fields_with_the_beta_client(client):
    message = client.beta.messages.create(
        model=MODEL, max_tokens=16, extra_body=GREEDY, betas=["context-management-2025-06-27"],
        messages=[{"role": "user", "content": "Say hello."}], mcp_servers=[], fallbacks="default",
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
        billing_policy={"type": "billing_policy", "bill_to": "self"}, thinking={"type": "adaptive"})
    assert message.context_management.applied_edits == [] and message.content[0].type == "text"


@pytest.mark.parametrize("field, value, param", [
    ("thinking", {"type": "enabled", "budget_tokens": 10}, "thinking.budget_tokens"),
    ("messages", [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}],
     "messages[0].content[0]"),
    ("tool_choice", {"type": "any"}, "tool_choice"),
])
def test_a_value_this_server_cannot_honour_is_an_anthropic_400_naming_it(client, field, value, param):
    body = {"model": MODEL, "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**body)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param + ":")


def test_a_server_tool_beside_a_client_tool_is_left_out_and_named(client, server):
    """As agents on the anthropic SDK list Anthropic's web search with their own tools."""
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, web_search]}
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=4, extra_body=GREEDY, **body)
    assert raw.status_code == 200 and raw.headers["x-tokenway-omitted-tools"] == "web_search_20250305"
    message = raw.parse()
    assert message.usage.output_tokens > 0 and server.ledger_row(message.id)["status"] == 200
    # What the model saw: the client tool alone, as count_tokens counts it.
    alone = client.messages.count_tokens(model=MODEL, messages=body["messages"], tools=[WEATHER]).input_tokens
    usage = message.usage
    assert client.messages.count_tokens(model=MODEL, **body).input_tokens == alone == (
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)
    with pytest.raises(anthropic.BadRequestError) as forced:  # only Anthropic's search could answer it
        client.messages.create(model=MODEL, max_tokens=4, tool_choice={"type": "tool", "name": "web_search"}, **body)
    error = forced.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("tool_choice: names tool 'web_search', a web_search_20250305 server tool")


def test_count_tokens_is_the_prompt_of_the_same_call(client):
    body = {"system": f"{nonce()} Be terse.", "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    counted = client.messages.count_tokens(model=MODEL, **body)
    usage = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, **body).usage
    # A new prompt and no breakpoint: nothing read from the cache, nothing written at a breakpoint.
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, 0)
    assert counted.input_tokens == usage.input_tokens > 50


def test_a_breakpoint_writes_its_prefix_and_the_next_call_reads_it(client):
    manual = f"{nonce()} " + " ".join(f"Rule {i}: answer politely and briefly." for i in range(30))
    system = [{"type": "text", "text": manual, "cache_control": {"type": "ephemeral"}}]

    def call(question: str) -> tuple[anthropic.types.Usage, int]:
        body = {"system": system, "messages": [{"role": "user", "content": question}]}
        counted = client.messages.count_tokens(model=MODEL, **body).input_tokens
        return client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, **body).usage, counted

    first, num_first = call("What is rule 3?")
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 250
    assert 0 < first.input_tokens < 40  # the question and the template's framing after the breakpoint
    second, num_second = call("And rule 7?")
    assert second.cache_read_input_tokens > 0
    # What the cache served of the prefix is read, not written again.
    assert second.cache_creation_input_tokens == max(0, first.cache_creation_input_tokens
                                                     - second.cache_read_input_tokens)
    for usage, num_tokens in ((first, num_first), (second, num_second)):
        assert usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens == num_tokens


def test_max_tokens_0_warms_the_cache(client):
    body = {"system": f"{nonce()} " + "Be brief. " * 80, "messages": [{"role": "user", "content": "Hi."}]}
    warm = client.messages.create(model=MODEL, max_tokens=0, **body)
    assert (warm.content, warm.stop_reason) == ([], "max_tokens")
    assert client.messages.create(model=MODEL, max_tokens=4, **body).usage.cache_read_input_tokens > 100


def test_count_tokens_errors_are_anthropic_shaped(server):
    response = httpx.post(f"{server.base_url}/v1/messages/count_tokens", json={"model": MODEL}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
