"""The official anthropic SDK against the same server's /v1/messages.

This SDK release no longer has a `temperature` argument; the API still takes the field, so
the tests send it through extra_body for repeatable (greedy) output."""

from __future__ import annotations

import anthropic
import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_messages_create(client):
    message = client.messages.create(model=MODEL, max_tokens=20, extra_body={"temperature": 0},
                                     system="You answer in one short sentence.",
                                     messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert message.role == "assistant" and message.type == "message"
    assert "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and message.usage.output_tokens > 0


def test_messages_stream(client):
    kwargs = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Name three fruits."}])
    full = client.messages.create(**kwargs).content[0].text
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full
    assert final.content[0].text == full and final.stop_reason in ("end_turn", "max_tokens")
    events = [e.type for e in client.messages.create(**kwargs, stream=True)]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)


def test_stop_sequence(client):
    message = client.messages.create(model=MODEL, max_tokens=40, extra_body={"temperature": 0}, stop_sequences=["5"],
                                     messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "5"
    assert "5" not in message.content[0].text


def test_errors_are_anthropic_shaped(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as excinfo:
        client.messages.create(model=MODEL, max_tokens=-1, messages=[{"role": "user", "content": "hi"}])
    assert excinfo.value.body["type"] == "error"
    assert excinfo.value.body["error"]["type"] == "invalid_request_error"


def test_a_last_assistant_message_is_prefill_the_reply_goes_on_from(client):
    ask = [{"role": "user", "content": "List three colours, comma-separated."}]
    whole = client.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                                   messages=ask).content[0].text
    begun = " ".join(whole.split(" ")[:2])  # at a word's end: "The th" would re-tokenize unlike the reply
    rest = client.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                                  messages=[*ask, {"role": "assistant", "content": begun}]).content[0].text
    assert (begun + rest).startswith(whole[:len(begun) + 8])
