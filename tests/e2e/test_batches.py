"""The Batch APIs with the official SDKs, unchanged, against a real `tokenway serve`: a batch's
200 lines run on the server's runner and answer exactly what the same requests answer one by one
(greedy, float32), a bad line lands in the error file, a cancelled batch stops, and Anthropic's
Message Batches give their results the same way."""

from __future__ import annotations

import json
import time

import anthropic
import numpy as np
import openai
import pytest

MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
TOPICS = ("the sea", "a cat", "rain", "bread", "a clock", "the moon", "a bridge", "snow", "a violin", "tea")
DEADLINE_S = 300  # how long a batch may take before the test gives up waiting (not a speed check)
NUM_LINES = 200  # the size: the runner must go round its capacity several times


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_body(topic: str, max_tokens: int = 12) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0}


def topic_of(i: int) -> str:
    return f"{TOPICS[i % len(TOPICS)]} ({i})"


def run(client, lines: list[dict], endpoint: str):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("requests.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h",
                                  metadata={"test": "e2e"})
    assert batch.status == "in_progress" and batch.input_file_id == file.id
    return wait(client, batch.id)


def wait(client, batch_id: str):
    deadline = time.monotonic() + DEADLINE_S
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)
    return batch


def lines_of(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {line["custom_id"]: line for line in lines}


def test_a_chat_batch_answers_as_its_requests_one_by_one(client, server):
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": chat_body(topic_of(i), max_tokens=6)} for i in range(NUM_LINES)]
    lines.insert(NUM_LINES // 2, {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {**chat_body("x"), "temperature": 5}})
    batch = run(client, lines, "/v1/chat/completions")
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (NUM_LINES + 1, NUM_LINES, 1)
    assert batch.metadata == {"test": "e2e"} and batch.model == MODEL and batch.completed_at is not None
    outputs, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert sorted(outputs) == sorted(f"chat-{i}" for i in range(NUM_LINES)) and list(errors) == ["bad"]
    bad = errors["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    for i in range(NUM_LINES):
        line = outputs[f"chat-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        answered = line["response"]["body"]
        alone = client.chat.completions.create(**chat_body(topic_of(i), max_tokens=6))
        assert answered["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert answered["usage"]["completion_tokens"] == alone.usage.completion_tokens
    # Each line is one ledger row, under the id its answer names.
    first = outputs["chat-0"]["response"]
    assert first["request_id"] == first["body"]["id"]
    assert server.ledger_row(first["request_id"])["status"] == 200


def test_an_embeddings_batch_answers_as_its_requests_one_by_one(client):
    texts = [f"A short note about {topic_of(i)}." for i in range(NUM_LINES)]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": EMBEDDING_MODEL, "input": text, "encoding_format": "float"}}
             for i, text in enumerate(texts)]
    batch = run(client, lines, "/v1/embeddings")
    assert batch.status == "completed" and batch.request_counts.completed == len(texts) and batch.error_file_id is None
    outputs = lines_of(client, batch.output_file_id)
    for i, text in enumerate(texts):
        answered = np.array(outputs[f"e{i}"]["response"]["body"]["data"][0]["embedding"])
        alone = np.array(client.embeddings.create(model=EMBEDDING_MODEL, input=text,
                                                  encoding_format="float").data[0].embedding)
        np.testing.assert_allclose(answered, alone, atol=1e-5)


def test_a_cancelled_batch_runs_no_more_lines(client):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**chat_body(TOPICS[i % len(TOPICS)]), "max_tokens": 64}} for i in range(40)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("requests.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    errors = lines_of(client, batch.error_file_id)
    cancelled = [line for line in errors.values() if line["error"] and line["error"]["code"] == "batch_cancelled"]
    done = len(lines_of(client, batch.output_file_id))
    # What ended before the cancel is kept; every other line, those running then too, is reported cancelled.
    assert cancelled and done + len(errors) == len(lines)


def test_a_message_batch_answers_as_its_requests_one_by_one(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    def params(topic: str) -> dict:
        return {"model": MODEL, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]}

    requests = [{"custom_id": f"m{i}", "params": params(topic)} for i, topic in enumerate(TOPICS[:6])]
    requests.append({"custom_id": "bad", "params": {**params("x"), "messages": []}})
    batch = client.messages.batches.create(requests=requests)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == len(requests)
    deadline = time.monotonic() + DEADLINE_S
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (6, 1) and batch.ended_at is not None
    results = {result.custom_id: result.result for result in client.messages.batches.results(batch.id)}
    assert results["bad"].type == "errored" and results["bad"].error.error.type == "invalid_request_error"
    for i, topic in enumerate(TOPICS[:6]):
        result = results[f"m{i}"]
        assert result.type == "succeeded"
        # This SDK's create has no temperature argument; the API takes the field (as the batch's params do).
        alone = client.messages.create(**{k: v for k, v in params(topic).items() if k != "temperature"},
                                       extra_body={"temperature": 0})
        assert result.message.content[0].text == alone.content[0].text
    assert batch.id in [listed.id for listed in client.messages.batches.list(limit=100)]
