"""A reasoning model on /v1/responses, driven by the openai SDK against a real server: the default
model under Qwen3's chat template (tests/fixtures), its replies read as starting inside their
thinking (--reasoning-parser deepseek_r1, whose replies always do), so that a greedy fp32 reply
has a thinking part whatever the small model writes, ended by the engine where reasoning.effort's
budget is spent. The reply is a reasoning item, then the message, streamed as OpenAI's SDK
types it; the thinking a conversation carries (stored and continued by previous_response_id,
or passed back as items, by content or by encrypted_content alone) reaches the template, which
renders it for the turn after the last user message."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from .conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
QWEN3 = REPO / "tests" / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
MINIMAL_BUDGET = 128  # reasoning.effort minimal's thinking budget (protocol/sampling.py EFFORT_BUDGETS)
# Long enough that the thinking runs past its budget, so the reply goes on to its answer.
COUNT = dict(model=MODEL, input="Count from 1 to 100, one number a line.", reasoning={"effort": "minimal"},
             max_output_tokens=MINIMAL_BUDGET + 40, temperature=0)


@pytest.fixture(scope="module")
def server(default_model_dir):
    assert Path(QWEN3).is_file()
    server = Server("--chat-template", str(QWEN3), "--reasoning-parser", "deepseek_r1", "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_reply_is_its_reasoning_item_then_its_message_streamed_as_created(client, server):
    whole = client.responses.create(**COUNT)
    reasoning, message = whole.output
    assert (reasoning.type, reasoning.status, reasoning.summary, reasoning.encrypted_content) == \
        ("reasoning", "completed", [], None)
    [thought] = reasoning.content
    assert thought.type == "reasoning_text" and thought.text.strip() and "</think>" not in thought.text
    assert message.type == "message" and whole.output_text.strip() and "<think>" not in whole.output_text
    assert whole.usage.output_tokens_details.reasoning_tokens == MINIMAL_BUDGET
    assert server.ledger_row(whole.id)["reasoning_tokens"] == MINIMAL_BUDGET

    with client.responses.stream(**COUNT) as stream:
        events = list(stream)  # cut by max_output_tokens: it ends with response.incomplete
    kinds = [event.type for event in events]
    assert kinds[:6] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.reasoning_text.delta",
                         "response.reasoning_text.delta"]
    assert kinds[-1] == "response.incomplete" and [e.sequence_number for e in events] == list(range(len(events)))
    thinking_ends = kinds.index("response.reasoning_text.done")
    assert kinds[thinking_ends:thinking_ends + 4] == ["response.reasoning_text.done", "response.content_part.done",
                                                      "response.output_item.done", "response.output_item.added"]
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    [done] = [event for event in events if event.type == "response.reasoning_text.done"]
    assert streamed == done.text == thought.text
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == MINIMAL_BUDGET


def test_effort_none_turns_the_thinking_off(client):
    response = client.responses.create(model=MODEL, input="Say hi.", reasoning={"effort": "none"},
                                       max_output_tokens=8, temperature=0)
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def count(client, **kwargs) -> int:
    return client.responses.input_tokens.count(model=MODEL, **kwargs).input_tokens


def test_the_thinking_a_conversation_carries_reaches_the_template(client):
    stored = client.responses.create(**COUNT)
    reasoning, message = stored.output
    user = {"role": "user", "content": COUNT["input"]}
    # Continued with nothing new, the last turn is the reply itself, which Qwen3's template
    # renders with its thinking (it leaves out the thinking of turns before the last user message).
    continued = count(client, previous_response_id=stored.id)
    passed_back = count(client, input=[user, reasoning.model_dump(exclude_none=True),
                                       message.model_dump(exclude_none=True)])
    without = count(client, input=[user, message.model_dump(exclude_none=True)])
    assert continued == passed_back and continued - without >= MINIMAL_BUDGET // 2

    # Not stored, the item comes back with encrypted_content; alone it carries the same thinking.
    unstored = client.responses.create(**COUNT, store=False, include=["reasoning.encrypted_content"])
    sealed = unstored.output[0]
    assert sealed.type == "reasoning" and sealed.encrypted_content and sealed.content == reasoning.content
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    only_sealed = {"type": "reasoning", "id": sealed.id, "summary": [], "encrypted_content": sealed.encrypted_content}
    assert count(client, input=[user, only_sealed, unstored.output[1].model_dump(exclude_none=True)]) == passed_back
    # Another server's encrypted_content cannot be read here: that item is kept out of the prompt.
    foreign = {**only_sealed, "encrypted_content": "gAAAAABo-opaque"}
    assert count(client, input=[user, foreign, message.model_dump(exclude_none=True)]) == without
