"""Deferred batch lines are billed as they were served, on a real `tokenway serve` with the
official SDKs: a key with `--max-concurrent 2` (its batch share: one line at a time) runs a
6-line OpenAI batch and a 6-request Message Batch, most lines refused for now (429) and run
again later. On the SQLite ledger and on PostgreSQL, the ledger rows, /v1/usage, the traces and
the output files agree line by line: one row a line, status 200, its tokens and its cost, and no
refused attempt counted. Restarted, the key's budget (seeded from the ledger) counts every line's
spend."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tokenway.gateway.budgets import format_usd

from .conftest import Server, free_port
from .test_gateway_policy import create_key, wait_for

MODEL = "smollm2-135m-instruct"
# $0.001 a token in and out (the batch tier: half that): a row's cost is exact in micro-dollars.
PRICES = f'[prices."{MODEL}"]\ninput = 1000.0\ncached_input = 1000.0\noutput = 1000.0\n'
BATCH_USD_PER_TOKEN = 0.0005
BUDGET_USD = 2.0  # its batch share ($1) holds the 12 lines many times over
NUM_LINES = 6
MAX_TOKENS = 8
DEADLINE_S = 300  # how long the batches may take before the test gives up (not a speed check)


def body(i: int) -> dict:
    # ignore_eos: every line generates MAX_TOKENS, so the one running holds the key's slot a while.
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}


def ledger_reader(ledger: str, db: Path, pg_url: str | None):
    """key_id -> its ledger rows (dicts), read from the database the server writes."""

    def read(key_id: str) -> list[dict]:
        query = "SELECT * FROM usage_ledger WHERE key_id = {}"
        if ledger == "postgres":
            import psycopg
            from psycopg.rows import dict_row

            with psycopg.connect(pg_url, row_factory=dict_row) as conn:
                return list(conn.execute(query.format("%s"), (key_id,)).fetchall())
        with sqlite3.connect(db) as conn:
            conn.row_factory = sqlite3.Row
            return [dict(row) for row in conn.execute(query.format("?"), (key_id,))]

    return read


def run_openai_batch(base_url: str, key: str) -> list[dict]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
    content = "".join(json.dumps({"custom_id": f"o{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body(i)}) + "\n" for i in range(NUM_LINES)).encode()
    file = client.files.create(file=("requests.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + DEADLINE_S
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (NUM_LINES, 0), batch
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"o{i}" for i in range(NUM_LINES)]
    # What each line was served: (request id, status, prompt tokens, completion tokens).
    served = []
    for line in lines:
        response = line["response"]
        usage = response["body"]["usage"]
        assert response["request_id"] == response["body"]["id"]
        served.append({"request_id": response["request_id"], "status": response["status_code"],
                       "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]})
    return served


def run_message_batch(base_url: str, key: str) -> list[dict]:
    client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    # ignore_eos is tokenway's extension of OpenAI's body; Anthropic's has none.
    params = [{name: value for name, value in body(i).items() if name != "ignore_eos"} for i in range(NUM_LINES)]
    batch = client.messages.batches.create(requests=[{"custom_id": f"m{i}", "params": params[i]}
                                                     for i in range(NUM_LINES)])
    deadline = time.monotonic() + DEADLINE_S
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (NUM_LINES, 0), batch
    served = []
    for result in client.messages.batches.results(batch.id):
        assert result.result.type == "succeeded", result
        message = result.result.message
        usage = message.usage
        prompt_tokens = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (
            usage.cache_creation_input_tokens or 0)
        served.append({"request_id": message.id, "status": 200, "prompt_tokens": prompt_tokens,
                       "completion_tokens": usage.output_tokens})
    assert len(served) == NUM_LINES
    return served


def num_deferred(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tokenway_batch_line_deferrals_total"))


@pytest.mark.parametrize("ledger", ["sqlite", "postgres"])
def test_deferred_lines_are_billed_as_served_and_survive_a_restart(default_model_dir, tmp_path, request, ledger):
    pg_url = request.getfixturevalue("postgres_database") if ledger == "postgres" else None
    db, port = tmp_path / "tokenway.db", free_port()
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES)
    args = ("--config", str(prices), "--no-embeddings", *(("--ledger-url", pg_url) if pg_url else ()))
    key = create_key(db, "--name", "batcher", "--max-concurrent", "2", "--budget-usd", str(BUDGET_USD))
    key_id = key.split("-")[1]
    rows_of = ledger_reader(ledger, db, pg_url)
    auth = {"Authorization": f"Bearer {key}"}

    server = Server(*args, db=db, port=port)
    try:
        # The reproducer holds for each batch: lines refused for now and run again (else this
        # proves nothing).
        before = num_deferred(server.base_url)
        served = run_openai_batch(server.base_url, key)
        between = num_deferred(server.base_url)
        served += run_message_batch(server.base_url, key)
        assert before < between < num_deferred(server.base_url), (before, between)
        rows = wait_for(lambda: rows if len(rows := rows_of(key_id)) >= len(served) else None, timeout=15)
        time.sleep(0.5)  # a second row for a line, were one coming, would be committed by now
        rows = rows_of(key_id)
        # Line by line: one row each, under the id its answer names, with what it was served.
        assert sorted(row["request_id"] for row in rows) == sorted(line["request_id"] for line in served)
        by_id = {row["request_id"]: row for row in rows}
        for line in served:
            row = by_id[line["request_id"]]
            assert {name: row[name] for name in line} == line
            assert row["service_tier"] == "batch"
            tokens = line["prompt_tokens"] + line["completion_tokens"]
            assert row["cost_usd"] == pytest.approx(tokens * BATCH_USD_PER_TOKEN)
        total_usd = sum(row["cost_usd"] for row in rows)
        # /v1/usage: every line a request served, none refused.
        usage = httpx.get(f"{server.base_url}/v1/usage", headers=auth, timeout=10).json()["data"]
        [batch_usage] = [entry for entry in usage if entry["service_tier"] == "batch"]
        assert (batch_usage["requests"], batch_usage["refused_requests"]) == (len(served), 0), usage
        assert batch_usage["prompt_tokens"] == sum(line["prompt_tokens"] for line in served)
        assert batch_usage["completion_tokens"] == sum(line["completion_tokens"] for line in served)
        assert batch_usage["cost_usd"] == pytest.approx(total_usd)
        # The traces: one a line, as its row; no refused attempt traced.
        traces = httpx.get(f"{server.base_url}/v1/traces", params={"limit": 100}, headers=auth,
                           timeout=10).json()["data"]
        line_traces = [trace for trace in traces if trace["batch_line"] is not None]
        assert sorted(trace["request_id"] for trace in line_traces) == sorted(by_id)
        for trace in line_traces:
            row = by_id[trace["request_id"]]
            assert (trace["status"], trace["prompt_tokens"], trace["completion_tokens"]) == (
                200, row["prompt_tokens"], row["completion_tokens"])
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]

    restarted = Server(*args, db=db, port=port)
    try:
        # The budget is seeded from the ledger: what remains is the budget less every line's spend.
        response = httpx.post(f"{restarted.base_url}/v1/chat/completions", headers=auth, timeout=60,
                              json={**body(0), "max_tokens": 2000})
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        remaining = format_usd(round(BUDGET_USD * 1e9) - round(total_usd * 1e9))
        assert error["code"] == "insufficient_quota"
        assert f"more than the {remaining} that remains of this API key's" in error["message"], error
    finally:
        assert restarted.stop() == 0, restarted.read_log()[-3000:]
