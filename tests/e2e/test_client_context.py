"""tokenway.client.context against a real tokenway serve: a 20-turn conversation over the
window fails with context_length_exceeded; each strategy fits it under the budget, keeps the
system prompt, the last turn and every tool call with its result, says what it cut, and the
request then succeeds with exactly the prompt tokens the report predicted."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.conftest import Server
from tokenway.client import LocalCounter, RemoteCounter
from tokenway.client.context import SUMMARY_PREFIX, ContextTooSmall, CutReport, fit, units_of
from tokenway.client.counting import OverWindow

MODEL = "smollm2-135m-instruct"
WINDOW = 1024  # a server with a small window: the conversation is ~3x over it, cheaply
TOPICS = ["ships", "rivers", "bread", "clocks", "bees", "glass", "trains", "maps", "salt", "wool"]


def conversation() -> list[dict]:
    messages = [{"role": "system", "content": "You are a patient historian."}]
    for turn in range(20):
        topic = TOPICS[turn % len(TOPICS)]
        messages.append({"role": "user",
                         "content": f"Turn {turn}: tell me about {topic}. " + f"{topic} and history " * 12})
        if turn == 7:  # a tool call and its result: one unit, never split
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7", "type": "function",
                 "function": {"name": "lookup", "arguments": json.dumps({"q": topic})}}]})
            messages.append({"role": "tool", "tool_call_id": "call_7", "content": "An old record about " + topic})
        messages.append({"role": "assistant", "content": f"About {topic}: " + "a long answer " * 10})
    messages.append({"role": "user", "content": "Now, in one sentence: which topic was first?"})
    return messages


@pytest.fixture(scope="module")
def client(default_model_dir):
    server = Server("--no-embeddings", "--max-model-len", str(WINDOW))
    yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert server.stop() == 0


@pytest.fixture(scope="module")
def counter(default_model_dir):
    return LocalCounter(str(default_model_dir))


def test_the_whole_conversation_is_over_the_window(client, counter):
    request = {"model": MODEL, "messages": conversation()}
    assert counter.count(request) > WINDOW
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request, max_tokens=64)
    assert refused.value.code == "context_length_exceeded"


@pytest.mark.parametrize("strategy,options", [
    ("drop_oldest", {}), ("sliding_window", {"keep_last": 8}), ("keep_first_and_recent", {}), ("summarize", {})])
def test_each_strategy_fits_and_the_call_then_succeeds(client, counter, strategy, options):
    messages = conversation()
    summaries = []

    def summarize(old: list) -> str:  # the same server, asked for a short summary
        text = "\n".join(f"{m['role']}: {(m.get('content') or '')[:60]}" for m in old)
        reply = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=[
            {"role": "user", "content": "Summarise this conversation in two sentences:\n" + text[-1500:]}])
        summaries.append(reply.choices[0].message.content)
        return summaries[-1]

    fitted, report = fit({"model": MODEL, "messages": messages}, counter, window=WINDOW, max_tokens=64,
                         strategy=strategy, summarize=summarize if strategy == "summarize" else None, **options)
    assert isinstance(report, CutReport) and report.cut and report.budget == WINDOW - 64
    assert report.prompt_tokens_before > WINDOW >= report.budget >= report.prompt_tokens_after
    kept = fitted["messages"]
    assert kept[0] == messages[0] and kept[-1] == messages[-1]  # the system prompt and the last turn
    call_kept = any(m.get("tool_calls") for m in kept)
    assert call_kept == any(m["role"] == "tool" for m in kept)  # a call and its result go together
    assert set(report.dropped) == {i for i, m in enumerate(messages) if not any(m is k for k in kept)}
    if strategy == "keep_first_and_recent":
        assert kept[1] == messages[1]  # the task as first stated
    if strategy == "sliding_window":
        assert len(units_of(kept)[1]) <= 8
    if strategy == "summarize":
        assert report.summarized and kept[1]["content"] == SUMMARY_PREFIX + summaries[-1]
    reply = client.chat.completions.create(**fitted, temperature=0)
    assert reply.usage.prompt_tokens == report.prompt_tokens_after


def test_a_request_that_fits_is_untouched_and_one_that_cannot_is_refused(counter):
    short = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}]}
    fitted, report = fit(short, counter, window=WINDOW, max_tokens=64)
    assert fitted["messages"] == short["messages"] and not report.cut
    with pytest.raises(ContextTooSmall):
        fit({"model": MODEL, "messages": conversation()}, counter, window=80, max_tokens=64)


def test_summarize_refuses_a_request_with_nothing_to_summarize(counter):
    # The system prompt and the last turn alone are over the budget: a summary of nothing
    # cannot make room, so it is refused as every other strategy refuses it.
    last_turn_only = {"model": MODEL, "messages": [conversation()[0], conversation()[-1]]}
    with pytest.raises(ContextTooSmall, match="the system prompt and the last turn need"):
        fit(last_turn_only, counter, window=80, max_tokens=64, strategy="summarize", summarize=lambda old: "")


def test_the_servers_counter_fits_it_too(client):
    remote = RemoteCounter(client)
    with pytest.raises(OverWindow):  # the server counts no further than the window
        remote.count({"model": MODEL, "messages": conversation()})
    fitted, report = fit({"model": MODEL, "messages": conversation()}, remote, window=WINDOW, max_tokens=64)
    assert report.prompt_tokens_before is None and report.cut
    assert client.chat.completions.create(**fitted).usage.prompt_tokens == report.prompt_tokens_after
