"""A batch handed whole to an upstream's own Batch API: two real servers on loopback, B with the
engine and A a gateway only, whose models are B behind an `openai` and an `anthropic` replica
with batch_api = true. Through A, with the official SDKs: the batch runs on B (B's own Batch
APIs list it), A's results equal the same requests sent one by one (greedy), A's ledger has one
row a line at the batch price, and a cancel reaches B."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from .conftest import Server

MODEL = "smollm2-135m-instruct"
PRICE = (1000.0, 2000.0)  # USD per million input (cached or not) and output tokens; a batch line pays half
DEADLINE_S = 180  # how long a batch may take before the test gives up waiting (not a speed check)
TOPICS = ("the sea", "a cat", "rain", "bread", "a clock", "the moon")


@pytest.fixture(scope="module")
def upstream(default_model_dir):
    # Two sequences at a time: a 40-line batch there outlasts the poll that forwards its cancel.
    server = Server("--no-embeddings", "--max-num-seqs", "2")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    config = tmp_path_factory.mktemp("forward") / "gateway.toml"
    config.write_text("".join(
        f'[[models]]\nname = "{name}"\ncontext_window = 2048\nhealth = {{interval_s = 3600}}\n'
        f'prices = {{input = {PRICE[0]}, cached_input = {PRICE[0]}, output = {PRICE[1]}}}\n'
        f'  [[models.replicas]]\n  kind = "{kind}"\n  name = "b"\n  url = "{upstream.base_url}/v1"\n'
        f'  model = "{MODEL}"\n  batch_api = true\n'
        for name, kind in (("remote", "openai"), ("remote-claude", "anthropic"))))
    server = Server("--config", str(config), "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_body(topic: str, max_tokens: int = 8) -> dict:
    return {"model": "remote", "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0}


def create(client, bodies: list[dict]):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    file = client.files.create(file=("requests.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()),
                               purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait(check, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not (value := check()):
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.3)
    return value


def upstream_batch(upstream: Server, batch_id: str) -> dict | None:
    """B's batch that A submitted for `batch_id` (A names it in the metadata)."""
    listed = httpx.get(f"{upstream.base_url}/v1/batches", params={"limit": 100}, timeout=10).json()["data"]
    return next((b for b in listed if (b.get("metadata") or {}).get("tokenway_batch_id") == batch_id), None)


def lines_of(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {line["custom_id"]: line for line in map(json.loads, client.files.content(file_id).text.splitlines())}


def test_a_batch_runs_on_the_upstream_and_answers_as_its_requests_one_by_one(client, gateway, upstream):
    bodies = [chat_body(topic) for topic in TOPICS]
    batch = create(client, bodies)
    assert batch.status == "in_progress"
    batch = wait(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                 f"batch {batch.id}")
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies), batch
    there = upstream_batch(upstream, batch.id)
    assert there is not None and there["status"] == "completed" and there["request_counts"]["total"] == len(bodies)
    outputs = lines_of(client, batch.output_file_id)
    assert sorted(outputs) == sorted(f"q{i}" for i in range(len(bodies))) and batch.error_file_id is None
    for i, body in enumerate(bodies):
        response = outputs[f"q{i}"]["response"]
        answered, alone = response["body"], client.chat.completions.create(**body)
        assert answered["model"] == "remote"
        assert answered["choices"][0]["message"]["content"] == alone.choices[0].message.content
        # One ledger row a line, under the id its output line names, at half the price.
        row = gateway.ledger_row(response["request_id"])
        usage = answered["usage"]
        assert (row["service_tier"], row["status"]) == ("batch", 200)
        assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == \
            (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])
        expected = (usage["prompt_tokens"] * PRICE[0] + usage["completion_tokens"] * PRICE[1]) / 2 / 1e6
        assert row["cost_usd"] == pytest.approx(expected)


def test_a_cancel_reaches_the_upstream(client, upstream):
    # Every line its whole max_tokens (ignore_eos): the upstream is still running the batch when
    # the cancel comes, whatever the machine's speed.
    batch = create(client, [{**chat_body(TOPICS[i % len(TOPICS)], max_tokens=128), "ignore_eos": True}
                            for i in range(40)])
    wait(lambda: upstream_batch(upstream, batch.id), "the upstream to have the batch")
    client.batches.cancel(batch.id)
    batch = wait(lambda: (b := client.batches.retrieve(batch.id)).status in ("cancelled", "completed") and b,
                 f"batch {batch.id} to end")
    assert batch.status == "cancelled"
    there = upstream_batch(upstream, batch.id)
    assert there["status"] == "cancelled"  # only a cancel makes it so
    # What B ran before the cancel came back as A's output; every other line is cancelled.
    outputs, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert len(outputs) == there["request_counts"]["completed"] and len(outputs) + len(errors) == 40
    assert errors and all(line["error"]["code"] == "batch_cancelled" for line in errors.values())


def test_a_message_batch_runs_on_the_upstream(gateway, upstream):
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)
    params = [{"model": "remote-claude", "max_tokens": 8, "temperature": 0,
               "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]}
              for topic in TOPICS[:3]]
    batch = client.messages.batches.create(requests=[{"custom_id": f"m{i}", "params": p}
                                                     for i, p in enumerate(params)])
    batch = wait(lambda: (b := client.messages.batches.retrieve(batch.id)).processing_status == "ended" and b,
                 f"message batch {batch.id}")
    assert batch.request_counts.succeeded == len(params), batch
    listed = httpx.get(f"{upstream.base_url}/v1/messages/batches", params={"limit": 100}, timeout=10).json()["data"]
    assert listed and listed[0]["processing_status"] == "ended"
    results = {result.custom_id: result.result for result in client.messages.batches.results(batch.id)}
    for i, p in enumerate(params):
        alone = client.messages.create(**{k: v for k, v in p.items() if k != "temperature"},
                                       extra_body={"temperature": 0})
        assert results[f"m{i}"].type == "succeeded"
        assert results[f"m{i}"].message.content[0].text == alone.content[0].text
