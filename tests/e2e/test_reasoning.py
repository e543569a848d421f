"""Reasoning models end to end: `tokenway serve` on the default model with Qwen3's chat template
(tests/fixtures, as Qwen3 ships it: --chat-template) and --reasoning-parser deepseek_r1, so the
reply starts inside its thinking as a thinking model's does (SmolLM2 never writes <think>
itself); the official openai SDK sees thinking and content apart, streamed and not, the
thinking's tokens in usage and in the ledger; the template's own switch turns thinking off;
an effort's budget ends the thinking and the answer follows."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
QWEN3_TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
HISTORY = [{"role": "user", "content": "Tell me about the history of Rome."}]  # a long reply


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = Server("--chat-template", str(QWEN3_TEMPLATE), "--reasoning-parser", "deepseek_r1", "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def thinking_of(message) -> str | None:
    """The thinking as clients read it: llama.cpp's and vLLM's names (the SDK keeps both as extras)."""
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content")


def test_thinking_and_content_come_apart_streamed_or_not_and_are_counted(client, server):
    kwargs = dict(model=MODEL, messages=HISTORY, max_tokens=16, temperature=0)
    response = client.chat.completions.create(**kwargs)
    choice, usage = response.choices[0], response.usage
    # Cut by max_tokens inside its thinking: all of the reply is thinking.
    thinking = thinking_of(choice.message)
    assert thinking and choice.message.content == "" and choice.finish_reason == "length"
    assert usage.completion_tokens == 16
    reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens <= 16
    assert server.ledger_row(response.id)["reasoning_tokens"] == reasoning_tokens

    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(thinking_of(delta) or "" for delta in deltas) == thinking
    assert "".join(delta.content or "" for delta in deltas) == ""
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert server.ledger_row(chunks[0].id)["reasoning_tokens"] == reasoning_tokens


def test_the_templates_switch_turns_thinking_off(client, server):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    by_kwargs = client.chat.completions.create(**kwargs,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    by_effort = client.chat.completions.create(**kwargs, reasoning_effort="none")
    for response in (by_kwargs, by_effort):
        message = response.choices[0].message
        assert thinking_of(message) is None and message.content
        assert response.usage.completion_tokens_details.reasoning_tokens == 0
        assert server.ledger_row(response.id)["reasoning_tokens"] == 0
    assert by_kwargs.choices[0].message.content == by_effort.choices[0].message.content
    # The template wrote an empty thinking part into the prompt: it is longer by that.
    thinking = client.chat.completions.create(**{**kwargs, "max_tokens": 1})
    assert by_effort.usage.prompt_tokens > thinking.usage.prompt_tokens


def test_thinking_passed_back_reaches_the_template(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}

    def messages(assistant: dict) -> list:
        return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call], **assistant},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]

    def prompt_tokens(assistant: dict) -> int:  # /tokenize templates messages as the chat call does
        response = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "messages": messages(assistant),
                                                                     "tools": [tool]}, timeout=30)
        return response.json()["count"]

    without = prompt_tokens({})
    # Qwen3's template renders a tool-calling turn's thinking back: the prompt holds it.
    with_thinking = prompt_tokens({"reasoning_content": "I add them with the tool."})
    assert with_thinking > without
    assert prompt_tokens({"reasoning": "I add them with the tool."}) == with_thinking  # vLLM's newer name
    response = client.chat.completions.create(model=MODEL, tools=[tool], max_tokens=1, temperature=0,
                                              messages=messages({"reasoning_content": "I add them with the tool."}))
    assert response.usage.prompt_tokens == with_thinking


def test_an_unknown_effort_and_a_server_variable_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort: must be one of none, minimal") as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, reasoning_effort="extreme")
    assert caught.value.param == "reasoning_effort"
    with pytest.raises(openai.BadRequestError, match="'add_generation_prompt' is set by the server") as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert caught.value.param == "chat_template_kwargs"


def test_a_budget_ends_the_thinking_and_the_answer_follows(client, server):
    # "minimal": 128 thinking tokens; the engine then writes the template's closing sequence.
    response = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=160, temperature=0,
                                              reasoning_effort="minimal")
    choice, usage = response.choices[0], response.usage
    thinking = thinking_of(choice.message)
    assert thinking and "</think>" not in thinking and "</think>" not in choice.message.content
    assert 0 < usage.completion_tokens_details.reasoning_tokens <= 128
    assert choice.message.content  # the answer after the thinking the budget ended
    assert server.ledger_row(response.id)["reasoning_tokens"] == usage.completion_tokens_details.reasoning_tokens
