"""Extended thinking through the anthropic SDK, against the default model served with a chat
template that thinks (DeepSeek-R1's distills': the generation prompt opens <think>): thinking
blocks before the text, streamed and not alike, accumulated by the SDK's stream helper, sent
back in the next turn; thinking off; a reply that reaches the window. (display "omitted" and
the stream's events one by one: tests/protocol/test_anthropic_replies.py.)

The window is small (1,100 tokens): the budget's 1,024 tokens of thinking and a few dozen of
text fill it, and no prompt here is long, since prefill is the slow part on a CPU."""

from __future__ import annotations

import anthropic
import pytest

from tests.e2e.conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
TEMPLATE = REPO / "tests/fixtures/chat_templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
WINDOW = 1100
GREEDY = {"temperature": 0}
THINKING = {"type": "enabled", "budget_tokens": 1024}
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client():
    server = Server("--no-embeddings", "--chat-template", str(TEMPLATE), "--max-model-len", str(WINDOW))
    yield anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def thought(client):
    """A reply with thinking on: 1024 tokens of it (the engine ends the part there), then text
    until the window; max_tokens far past the window is taken, as Anthropic's current models
    take it."""
    return client.messages.create(model=MODEL, max_tokens=64_000, thinking=THINKING, extra_body=GREEDY,
                                  messages=ASK)


def test_thinking_comes_first_then_the_text(thought):
    thinking, *rest = thought.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert [block.type for block in rest] == ["text"] and rest[0].text
    assert 0 < thought.usage.output_tokens_details.thinking_tokens <= 1024 < thought.usage.output_tokens


def test_a_reply_that_reaches_the_window_says_so(thought):
    assert thought.stop_reason == "model_context_window_exceeded"
    assert prompt_tokens(thought.usage) + thought.usage.output_tokens == WINDOW


def test_streamed_thinking_is_the_same_reply(client):
    # Thinking unasked: this template's model thinks until max_tokens, a short reply to stream.
    request = {"model": MODEL, "max_tokens": 40, "extra_body": GREEDY, "messages": ASK}
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


def test_thinking_goes_back_in_the_next_turn(client, thought):
    history = [*ASK, thought.to_param(), {"role": "user", "content": "And 3+3?"}]
    # Anthropic takes earlier turns' thinking whatever this turn asks.
    reply = client.messages.create(model=MODEL, max_tokens=40, thinking={"type": "disabled"}, extra_body=GREEDY,
                                   messages=history)
    assert reply.content and prompt_tokens(reply.usage) > prompt_tokens(thought.usage) + 10


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_thinking_off_closes_the_part_at_once(client):
    message = client.messages.create(model=MODEL, max_tokens=40, thinking={"type": "disabled"}, extra_body=GREEDY,
                                     messages=ASK)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.usage.output_tokens_details is None
