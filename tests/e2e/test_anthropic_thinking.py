"""Extended thinking through the anthropic SDK, against the default model served with Qwen3's
chat template (tests/fixtures, as Qwen3 ships it) and --reasoning-parser deepseek_r1, so the
reply starts inside its thinking as a thinking model's does (SmolLM2 never writes <think>
itself): thinking blocks before the text, the budget ending the thinking, streamed and not
alike, accumulated by the SDK's stream helper, sent back to the template in a tool loop;
the template's own switch turning thinking off; a reply that reaches the window. (display
"omitted" and the stream's events one by one: tests/protocol/test_anthropic_replies.py.)

The window is small (1,100 tokens): the budget's 1,024 tokens of thinking and a few dozen of
text fill it, and no prompt here is long, since prefill is the slow part on a CPU."""

from __future__ import annotations

import anthropic
import pytest

from tests.e2e.conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
QWEN3_TEMPLATE = REPO / "tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja"
WINDOW = 1100
GREEDY = {"temperature": 0}
THINKING = {"type": "enabled", "budget_tokens": 1024}
ASK = [{"role": "user", "content": "What is 2+2?"}]  # a short reply
HISTORY = [{"role": "user", "content": "Tell me about the history of Rome."}]  # a long one, greedy
ADD = {"name": "add", "description": "Adds two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


@pytest.fixture(scope="module")
def client():
    server = Server("--no-embeddings", "--chat-template", str(QWEN3_TEMPLATE), "--reasoning-parser", "deepseek_r1",
                    "--max-model-len", str(WINDOW))
    yield anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def thought(client):
    """A reply with thinking on: 1024 tokens of it (the engine ends the part there), then text
    until the window; max_tokens far past the window is taken, as Anthropic's current models
    take it."""
    return client.messages.create(model=MODEL, max_tokens=64_000, thinking=THINKING, extra_body=GREEDY,
                                  messages=HISTORY)


def test_thinking_comes_first_then_the_text(thought):
    thinking, *rest = thought.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert [block.type for block in rest] == ["text"] and rest[0].text
    assert 0 < thought.usage.output_tokens_details.thinking_tokens <= 1024 < thought.usage.output_tokens


def test_a_reply_that_reaches_the_window_says_so(thought):
    assert thought.stop_reason == "model_context_window_exceeded"
    assert prompt_tokens(thought.usage) + thought.usage.output_tokens == WINDOW


def test_streamed_thinking_is_the_same_reply(client):
    # Thinking unasked: this template's model thinks by default, here until max_tokens.
    request = {"model": MODEL, "max_tokens": 40, "extra_body": GREEDY, "messages": HISTORY}
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking"] and message.stop_reason == "max_tokens"
    # The same reply; only what the prefix cache served of the prompt differs, the second time.
    assert streamed.model_dump(exclude={"id", "usage"}) == message.model_dump(exclude={"id", "usage"})
    assert streamed.usage.output_tokens_details == message.usage.output_tokens_details
    assert "".join(event.thinking for event in events if event.type == "thinking") == message.content[0].thinking
    assert [event.signature for event in events if event.type == "signature"] == [message.content[0].signature]


def test_thinking_goes_back_to_the_template_in_a_tool_loop(client):
    # A short thought of the model's own, its signature as this server made it.
    thought = client.messages.create(model=MODEL, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
                                     extra_body=GREEDY, messages=ASK)
    thinking = thought.content[0]
    assert thinking.type == "thinking" and thinking.thinking
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 2}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"}]}

    def prompt_with(blocks: list) -> int:
        # Anthropic takes earlier turns' thinking whatever this turn asks.
        reply = client.messages.create(model=MODEL, max_tokens=1, thinking={"type": "disabled"}, extra_body=GREEDY,
                                       tools=[ADD], messages=[*ASK, {"role": "assistant", "content": blocks}, result])
        return prompt_tokens(reply.usage)

    # Qwen3's template keeps the thinking of the turns since the last question (a tool loop's).
    with_thinking, without = prompt_with([thinking.model_dump(), use]), prompt_with([use])
    assert with_thinking >= without + thought.usage.output_tokens_details.thinking_tokens


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_thinking_off_closes_the_part_at_once(client):
    message = client.messages.create(model=MODEL, max_tokens=40, thinking={"type": "disabled"}, extra_body=GREEDY,
                                     messages=ASK)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.usage.output_tokens_details is None
