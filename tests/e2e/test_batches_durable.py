"""Batches outlive their servers and spread over them: a `tokenway serve` killed with SIGKILL
mid-batch and started again on the same SQLite database finishes the batch with every line run
to one output line and one ledger row; two servers on one PostgreSQL database share a batch's
lines, and none runs on both.

Each server runs at most 4 sequences (--max-num-seqs 4), so a batch runs a few lines at a time:
some are done and some running at any moment (the kill lands between them), and one server's
runner cannot claim a whole batch before the other's first look."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import Server, free_port

MODEL = "smollm2-135m-instruct"
NUM_LINES = 30
DEADLINE_S = 300  # how long a batch may take before the test gives up waiting (not a speed check)
# The engine's scheduling has nothing to do with what these tests check; a small batch width makes
# lines run a few at a time.
SERVE_ARGS = ("--no-embeddings", "--max-num-seqs", "4")


def submit(server: Server, num_lines: int = NUM_LINES, **body: Any) -> tuple[openai.OpenAI, str, list[str]]:
    """A chat batch of num_lines short lines on the server (each line's body updated with `body`):
    (its client, the batch id, the custom_ids in line order)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    custom_ids = [f"line-{i}" for i in range(num_lines)]
    content = "".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": f"Say a word about the number {i}."}], **body}}) + "\n"
        for i, custom_id in enumerate(custom_ids)).encode()
    file = client.files.create(file=("requests.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "in_progress", batch
    return client, batch.id, custom_ids


def job_ids(batch_id: str, num_lines: int) -> set[str]:
    """The ids each line's call makes (its response's, its ledger row's): the line's own, every run."""
    return {f"chatcmpl-{batch_id.split('_', 1)[1]}l{index}" for index in range(num_lines)}


def wait_until(condition: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)
    return value


def finished(client: openai.OpenAI, batch_id: str):
    batch = client.batches.retrieve(batch_id)
    return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def check_outputs(client: openai.OpenAI, batch, custom_ids: list[str]) -> None:
    """Every line once in the output, answered 200 under its own job id."""
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (len(custom_ids), len(custom_ids))
    assert batch.error_file_id is None
    lines = output_lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(custom_ids)  # each once: no line lost or doubled
    expected = job_ids(batch.id, len(custom_ids))
    for line in lines:
        response = line["response"]
        assert line["error"] is None and response["status_code"] == 200, line
        index = custom_ids.index(line["custom_id"])
        assert response["body"]["id"] == f"chatcmpl-{batch.id.split('_', 1)[1]}l{index}" in expected


def sqlite_lines(db: Path, batch_id: str) -> dict[int, tuple[str, int]]:
    """line index -> (state, attempts), as the batch store holds them."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT line_index, state, attempts FROM batch_lines WHERE batch_id = ?",
                            (batch_id,)).fetchall()
    return {index: (state, attempts) for index, state, attempts in rows}


def sqlite_ledger_ids(db: Path, batch_id: str) -> list[str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT request_id, status, service_tier FROM usage_ledger WHERE request_id LIKE ?",
                            (f"%{batch_id.split('_', 1)[1]}l%",)).fetchall()
    assert all(status == 200 and tier == "batch" for _, status, tier in rows), rows
    return [request_id for request_id, _, _ in rows]


def test_a_batch_killed_mid_run_finishes_on_restart_with_each_line_once(default_model_dir, tmp_path):
    db, port = tmp_path / "batches.db", free_port()
    # A line whose server died runs again once its claim lapses: 2 s here, instead of a minute.
    args = (*SERVE_ARGS, "--batch-lease-seconds", "2")
    server = Server(*args, db=db, port=port)
    try:
        client, batch_id, custom_ids = submit(server)

        def some_done_some_running() -> bool:
            states = [state for state, _ in sqlite_lines(db, batch_id).values()]
            return states.count("done") >= 4 and states.count("claimed") >= 1

        wait_until(some_done_some_running, "lines done while others run")
        server.process.kill()  # SIGKILL: no drain, no flush; the ledger keeps what its journal holds
        server.process.wait()
    finally:
        server.stop()
    at_kill = sqlite_lines(db, batch_id)
    running = {index for index, (state, _) in at_kill.items() if state == "claimed"}
    done = {index for index, (state, _) in at_kill.items() if state == "done"}
    assert running and done and len(done) < NUM_LINES

    restarted = Server(*args, db=db, port=port)
    try:
        client = openai.OpenAI(base_url=f"{restarted.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        batch = wait_until(lambda: finished(client, batch_id), f"batch {batch_id} to end")
        check_outputs(client, batch, custom_ids)
        after = sqlite_lines(db, batch_id)
        # The lines the kill interrupted ran again (their claims lapsed); those done before did not.
        assert all(after[index][1] == 2 for index in running), (running, after)
        assert all(after[index][1] == 1 for index in done), (done, after)
        # One ledger row per line, under its job id: a line run twice wrote no second one, and a
        # row journaled before the kill but not yet committed was committed by the restart.
        ids = wait_until(lambda: (ids := sqlite_ledger_ids(db, batch_id)) and len(ids) >= NUM_LINES and ids,
                         "every line's ledger row", timeout=30)
        assert sorted(ids) == sorted(job_ids(batch_id, NUM_LINES))
    finally:
        assert restarted.stop() == 0, restarted.read_log()[-3000:]


def traced_ids(server: Server, expected: set[str]) -> set[str]:
    """The batch's calls this server ran: the traces in its memory (the ledger's are shared)."""
    traces = httpx.get(f"{server.base_url}/v1/traces", params={"limit": 2048}, timeout=10).json()["data"]
    return {trace["request_id"] for trace in traces} & expected


def test_two_servers_on_one_postgres_share_a_batch_and_run_each_line_once(default_model_dir, postgres_database):
    psycopg = pytest.importorskip("psycopg")
    # One after the other: two gateways sharing a data folder (and so their ledger journals'
    # folder) that start at the same instant may race for each other's journal file.
    first = Server(*SERVE_ARGS, "--ledger-url", postgres_database)
    try:
        second = Server(*SERVE_ARGS, "--ledger-url", postgres_database)
    except BaseException:
        first.stop()
        raise
    try:
        # Lines long enough that the batch outlasts the second server's next look for work (an
        # idle runner looks once a second; the first server's wakes when its batch is created,
        # and again as each line ends): 8-token lines were all done in under a second.
        client, batch_id, custom_ids = submit(first, max_tokens=64, ignore_eos=True)
        batch = wait_until(lambda: finished(client, batch_id), f"batch {batch_id} to end")
        check_outputs(client, batch, custom_ids)
        expected = job_ids(batch_id, NUM_LINES)
        ran_first, ran_second = traced_ids(first, expected), traced_ids(second, expected)
        assert ran_first and ran_second, (len(ran_first), len(ran_second))  # both took lines
        assert not ran_first & ran_second and ran_first | ran_second == expected
        with psycopg.connect(postgres_database) as conn:
            attempts = conn.execute("SELECT attempts FROM batch_lines WHERE batch_id = %s", (batch_id,)).fetchall()

            def ledger_ids() -> list[str]:
                rows = conn.execute("SELECT request_id FROM usage_ledger WHERE request_id LIKE %s",
                                    (f"%{batch_id.split('_', 1)[1]}l%",)).fetchall()
                return [row[0] for row in rows]

            ids = wait_until(lambda: len(ids := ledger_ids()) >= NUM_LINES and ids, "every line's ledger row",
                             timeout=30)
        assert sorted(attempts) == [(1,)] * NUM_LINES  # no claim was ever taken twice
        assert sorted(ids) == sorted(expected)
    finally:
        codes = [first.stop(), second.stop()]
        assert codes == [0, 0], first.read_log()[-2000:] + second.read_log()[-2000:]
