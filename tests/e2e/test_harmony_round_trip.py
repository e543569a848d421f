"""gpt-oss's Harmony through every API, end to end: a tiny random GptOssForCausalLM saved with a
tokenizer that has Harmony's special tokens and gpt-oss's chat template (tests/fixtures/
tiny_gpt_oss.py), served, and driven by the official openai SDK (chat completions, Responses)
and anthropic SDK. A forced call completes (the grammar writes Harmony's framing, the random
model picks the arguments the schema allows), its result goes back, and the next prompt holds
the call, its result and the passed-back thinking as Harmony; thinking under a budget comes
back as each API's reasoning."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import Server
from tests.fixtures.tiny_gpt_oss import build_model

MODEL = "tiny-gpt-oss"
ASK = "What's the weather in Rome?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Paris"]}},
                   "required": ["city"], "additionalProperties": False}}}
RESULT = '{"sunny": true, "celsius": 21}'


@pytest.fixture(scope="module")
def server(model_cache_dir):
    path = build_model(model_cache_dir / "tiny-harmony-models")
    server = Server("--model", str(path), "--served-model-name", MODEL, "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def prompt_text(server, messages: list[dict], tools: list[dict]) -> str:
    """The prompt tokenway renders for a chat call, as text (special tokens kept)."""
    token_ids = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "messages": messages,
                                                                 "tools": tools}).json()["tokens"]
    return httpx.post(f"{server.base_url}/detokenize", json={"model": MODEL, "tokens": token_ids}).json()["prompt"]


def check_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    assert json.loads(arguments) in ({"city": "Rome"}, {"city": "Paris"}), arguments


def test_chat_completions_round_trip(server, oa):
    request = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
                   tool_choice="required", max_tokens=120, temperature=0, reasoning_effort="none")
    reply = oa.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "tool_calls" and not reply.message.content
    (call,) = reply.message.tool_calls
    check_call(call.function.name, call.function.arguments)
    pieces, finish = {}, None
    for chunk in oa.chat.completions.create(**request, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            got = pieces.setdefault(piece.index, ["", "", 0])
            got[0] += piece.function.name or ""
            got[1] += piece.function.arguments or ""
            got[2] += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(pieces) == [0]
    assert pieces[0][:2] == [call.function.name, call.function.arguments] and pieces[0][2] > 2  # streamed as formed
    # The result goes back, with the thinking that led to the call.
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    text = prompt_text(server, messages, [WEATHER])
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>" \
           f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" \
           f"{call.function.arguments}<|call|>" \
           f"<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{RESULT}<|end|>" \
           "<|start|>assistant" in text
    after = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_thinking_under_a_budget_is_reasoning_content(oa):
    # A random model thinks to the budget the grammar bounds it by (minimal: 128 tokens), then calls.
    reply = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
                                       tool_choice="required", max_tokens=260, temperature=0,
                                       reasoning_effort="minimal")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)
    thinking = getattr(choice.message, "reasoning_content", None) or (choice.message.model_extra or {}).get(
        "reasoning_content")
    assert thinking and "<|" not in thinking
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0


def test_responses_round_trip(oa):
    tools = [{"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
              "parameters": WEATHER["function"]["parameters"]}]
    request = dict(model=MODEL, input=ASK, tools=tools, tool_choice="required", max_output_tokens=120,
                   temperature=0, reasoning={"effort": "none"})
    response = oa.responses.create(**request)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["function_call"]
    call = response.output[0]
    check_call(call.name, call.arguments)
    with oa.responses.stream(**request) as stream:
        arguments = "".join(event.delta for event in stream if event.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert [(item.name, item.arguments) for item in final.output if item.type == "function_call"] == \
        [(call.name, call.arguments)] and arguments == call.arguments
    follow = oa.responses.create(model=MODEL, tools=tools, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert follow.status in ("completed", "incomplete")
    # With a thinking budget, the thinking is a reasoning item before the call.
    thought = oa.responses.create(**{**request, "reasoning": {"effort": "minimal"}, "max_output_tokens": 260})
    assert [item.type for item in thought.output] == ["reasoning", "function_call"], thought.output


def test_messages_round_trip(an):
    tools = [{"name": "get_weather", "description": WEATHER["function"]["description"],
              "input_schema": WEATHER["function"]["parameters"]}]
    request = dict(model=MODEL, max_tokens=120, tools=tools, messages=[{"role": "user", "content": ASK}],
                   tool_choice={"type": "any"}, thinking={"type": "disabled"}, extra_body={"temperature": 0})
    reply = an.messages.create(**request)
    assert reply.stop_reason == "tool_use" and [block.type for block in reply.content] == ["tool_use"]
    block = reply.content[0]
    check_call(block.name, json.dumps(block.input))
    assert block.id.startswith("toolu_")
    with an.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content] == [(block.name, block.input)]
    follow = an.messages.create(model=MODEL, max_tokens=8, tools=tools, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name,
                                           "input": block.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # Thinking on, with Anthropic's least budget: a thinking block, then the call.
    thought = an.messages.create(**{**request, "max_tokens": 1300,
                                    "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert [b.type for b in thought.content] == ["thinking", "tool_use"], thought.content
    assert thought.content[0].thinking and "<|" not in thought.content[0].thinking
