"""The usage ledger against both backends: SQLite in a temp file, and a real PostgreSQL server
started by scripts/postgres.sh for the session (a fresh database per test)."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenway.billing.ledger import Ledger

from .conftest import DAY1, DAY2, make_record

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.anyio  # anyio's pytest plugin runs the async tests


async def test_a_recorded_row_reads_back_exactly_and_is_committed_when_record_returns(url):
    rec = make_record("req-1", cost_usd=0.1 + 0.2, cached_tokens=3, finish_reason=None, error="engine: out of memory",
                      status=500, stages_ms={"gateway": 0.123456789, "queue": 1e-9, "prefill": 7.0},
                      started_at=1_709_337_599.123456, finished_at=1_709_337_600.654321)
    async with Ledger(url) as ledger:
        await ledger.record(rec)
        async with Ledger(url) as other:  # its own connections: sees only what is committed
            assert await other.get("req-1") == rec
        assert await ledger.get("req-1") == rec
        assert await ledger.get("req-2") is None


async def test_a_duplicate_request_id_keeps_the_first_row_only(url):
    first = make_record("req-1", cost_usd=1.0)
    async with Ledger(url) as ledger:
        await ledger.record(first)
        await ledger.record(make_record("req-1", cost_usd=5.0, completion_tokens=99))
        # Both copies in one batch: still one row.
        await asyncio.gather(ledger.record(make_record("req-2", cost_usd=2.0)),
                             ledger.record(make_record("req-2", cost_usd=7.0)))
        assert await ledger.get("req-1") == first
        assert (await ledger.get("req-2")).cost_usd == 2.0
        [row] = await ledger.usage("key-a")
        assert (row["requests"], row["completion_tokens"], row["cost_usd"]) == (2, 10, 3.0)
        assert await ledger.spend_usd("key-a") == 3.0
        assert ledger.num_rows_written == 2


async def test_usage_groups_each_key_by_utc_day_model_and_tier_and_counts_refusals_apart(url):
    records = [
        make_record("a1", model="m1", prompt_tokens=10, cached_tokens=4, completion_tokens=1, cost_usd=0.5),
        make_record("a2", model="m1", prompt_tokens=20, cached_tokens=0, completion_tokens=2, cost_usd=0.25),
        make_record("a3", model="m2", prompt_tokens=30, cached_tokens=1, completion_tokens=3, cost_usd=1.0),
        make_record("a4", model="m1", prompt_tokens=40, cached_tokens=2, completion_tokens=4, cost_usd=2.0,
                    finished_at=DAY2),
        make_record("b1", key_id="key-b", model="m1", prompt_tokens=50, completion_tokens=5, cost_usd=4.0),
        # Refused: answered 4xx before anything ran (no tokens)...
        make_record("a5", model="m1", prompt_tokens=0, completion_tokens=0, cost_usd=0.0, status=429),
        make_record("a6", model="m2", prompt_tokens=0, completion_tokens=0, cost_usd=0.0, status=401),
        make_record("a7", model="m2", prompt_tokens=0, completion_tokens=0, cost_usd=0.0, status=498),
        # ...not so: a client that left (499), a failure (5xx), a 4xx that counted the prompt.
        make_record("a8", model="m1", prompt_tokens=0, completion_tokens=0, cost_usd=0.0, status=499),
        make_record("a9", model="m1", prompt_tokens=0, completion_tokens=0, cost_usd=0.0, status=503),
        make_record("a10", model="m1", prompt_tokens=7, completion_tokens=0, cost_usd=0.0, status=400),
        # The same key, day and model at another service tier: a row of its own.
        make_record("a11", model="m1", prompt_tokens=8, completion_tokens=1, cost_usd=0.125, service_tier="flex"),
    ]
    async with Ledger(url) as ledger:
        await asyncio.gather(*(ledger.record(rec) for rec in records))
        key_a = [
            {"key_id": "key-a", "day": "2024-03-01", "model": "m1", "service_tier": "default", "requests": 5,
             "refused_requests": 1, "prompt_tokens": 37, "cached_tokens": 4, "completion_tokens": 3,
             "reasoning_tokens": 0, "cost_usd": 0.75},
            {"key_id": "key-a", "day": "2024-03-01", "model": "m1", "service_tier": "flex", "requests": 1,
             "refused_requests": 0, "prompt_tokens": 8, "cached_tokens": 0, "completion_tokens": 1,
             "reasoning_tokens": 0, "cost_usd": 0.125},
            {"key_id": "key-a", "day": "2024-03-01", "model": "m2", "service_tier": "default", "requests": 1,
             "refused_requests": 2, "prompt_tokens": 30, "cached_tokens": 1, "completion_tokens": 3,
             "reasoning_tokens": 0, "cost_usd": 1.0},
            {"key_id": "key-a", "day": "2024-03-02", "model": "m1", "service_tier": "default", "requests": 1,
             "refused_requests": 0, "prompt_tokens": 40, "cached_tokens": 2, "completion_tokens": 4,
             "reasoning_tokens": 0, "cost_usd": 2.0},
        ]
        key_b = [{"key_id": "key-b", "day": "2024-03-01", "model": "m1", "service_tier": "default", "requests": 1,
                  "refused_requests": 0, "prompt_tokens": 50, "cached_tokens": 0, "completion_tokens": 5,
                  "reasoning_tokens": 0, "cost_usd": 4.0}]
        assert await ledger.usage("key-a") == key_a
        assert await ledger.usage(None) == key_a + key_b
        assert await ledger.usage("key-a", since=DAY2) == key_a[3:]  # since inclusive
        assert await ledger.usage("key-a", until=DAY2) == key_a[:3]  # until exclusive
        assert await ledger.usage("key-c") == []


async def test_spend_is_seeded_from_the_database_then_kept_as_a_running_total(url):
    async with Ledger(url) as ledger:
        await ledger.record(make_record("r1", cost_usd=1.5))
        await ledger.record(make_record("r2", key_id="key-b", cost_usd=100.0))
    async with Ledger(url) as ledger:
        assert await ledger.spend_usd("key-a") == 1.5  # from the rows a previous process wrote
        assert await ledger.spend_usd("nobody") == 0.0
        await ledger.record(make_record("r3", cost_usd=0.25))
        await ledger.record(make_record("r1", cost_usd=9.0))  # a retry: not billed again
        assert await ledger.spend_usd("key-a") == 1.75
        assert await ledger.spend_usd("key-b") == 100.0
    async with Ledger(url) as ledger:
        await ledger.close()
        assert await ledger.spend_usd("key-a") == 1.75  # closed: straight from SQL


async def test_concurrent_records_share_commits(url):
    num_rows = 2000
    async with Ledger(url) as ledger:
        await asyncio.gather(*(ledger.record(make_record(f"r{i}")) for i in range(num_rows)))
        assert ledger.num_rows_written == num_rows
        assert ledger.num_commits <= num_rows // 10
    async with Ledger(url, batch_max=50) as ledger:
        await asyncio.gather(*(ledger.record(make_record(f"s{i}")) for i in range(1000)))
        assert ledger.num_commits >= 1000 // 50  # no batch exceeds batch_max
        [row] = await ledger.usage("key-a")
        assert row["requests"] == num_rows + 1000


async def test_close_flushes_rows_queued_without_waiting(url):
    ledger = Ledger(url)
    for i in range(500):
        ledger.record_nowait(make_record(f"r{i}"))
    await ledger.close()
    with pytest.raises(RuntimeError, match="closed"):
        await ledger.record(make_record("late"))
    async with Ledger(url) as fresh:
        [row] = await fresh.usage("key-a")
        assert row["requests"] == 500


async def test_a_cancelled_caller_still_gets_its_row(url):
    async with Ledger(url) as ledger:
        task = asyncio.create_task(ledger.record(make_record("gone")))
        await asyncio.sleep(0)  # the row is queued
        task.cancel()
    async with Ledger(url) as fresh:
        assert await fresh.get("gone") is not None


CHILD = textwrap.dedent("""
    import asyncio, sys, time
    from tokenway.billing.ledger import Ledger, UsageRecord

    url, run, num_rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    journal_dir = sys.argv[4] if len(sys.argv) > 4 else None
    journal_name = sys.argv[5] if len(sys.argv) > 5 else "0"

    async def worker(ledger, request_ids):
        for request_id in request_ids:
            await ledger.record(UsageRecord(request_id, "crash-key", "m", 3, 0, 1, 0.001, "stop", None, 200,
                                            {"run": float(run)}, time.time(), time.time()))
            print(request_id, flush=True)  # only once the row is committed (or journaled)

    async def main():
        ledger = Ledger(url, journal_dir=journal_dir, journal_name=journal_name)
        request_ids = [f"req-{i}" for i in range(num_rows)]
        await asyncio.gather(*(worker(ledger, request_ids[w::32]) for w in range(32)))
        print(f"written {ledger.num_rows_written}", flush=True)
        if run == "1":
            await asyncio.sleep(3600)  # wait for the SIGKILL
        await ledger.close()

    asyncio.run(main())
""")


def run_child(url: str, run: str, num_rows: int, kill_after: int | None,
              journal: tuple[str, str] | None = None) -> tuple[list[str], int]:
    """journal: (folder, gateway name)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [sys.executable, "-c", CHILD, url, run, str(num_rows)] + (list(journal) if journal else [])
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in child.stdout:
        lines.append(line.strip())
        if kill_after is not None and len(lines) == kill_after:
            child.send_signal(signal.SIGKILL)
    child.stdout.close()
    return lines, child.wait()


async def test_kill_9_loses_no_acknowledged_row_and_a_rerun_writes_none_twice(url):
    num_rows = 20_000
    printed, returncode = run_child(url, "1", num_rows, kill_after=300)
    assert returncode == -signal.SIGKILL
    acknowledged = [line for line in printed if line.startswith("req-")]
    assert len(acknowledged) >= 300
    async with Ledger(url) as ledger:
        for request_id in acknowledged:
            rec = await ledger.get(request_id)
            assert rec is not None and rec.stages_ms == {"run": 1.0}, request_id
        [row] = await ledger.usage("crash-key")
        num_survived = row["requests"]  # acknowledged rows, plus any committed just before the kill
        assert len(acknowledged) <= num_survived <= num_rows

    printed, returncode = run_child(url, "2", num_rows, kill_after=None)  # a restart replays every id
    assert returncode == 0
    assert printed[-1] == f"written {num_rows - num_survived}"
    async with Ledger(url) as ledger:
        [row] = await ledger.usage("crash-key")
        assert row["requests"] == num_rows
        for request_id in acknowledged:
            assert (await ledger.get(request_id)).stages_ms == {"run": 1.0}  # the first write stands


async def test_with_a_journal_record_returns_before_the_commit_and_kill_9_loses_nothing(url, tmp_path):
    printed, returncode = run_child(url, "1", 5_000, kill_after=1_000, journal=(str(tmp_path), "8000"))
    assert returncode == -signal.SIGKILL
    acknowledged = [line for line in printed if line.startswith("req-")]
    assert len(acknowledged) >= 1_000
    [journal] = tmp_path.glob("ledger-*-8000.journal")
    # The next start replays what the journal still holds, then empties it: here a gateway
    # that comes back on another port (another journal file) adopts the dead one's journal.
    async with Ledger(url, journal_dir=tmp_path, journal_name="8001") as ledger:
        restarted_journal = ledger.journal_path
    async with Ledger(url) as ledger:
        for request_id in acknowledged:
            assert await ledger.get(request_id) is not None, request_id
        [row] = await ledger.usage("crash-key")
        assert len(acknowledged) <= row["requests"] <= 5_000
    assert not journal.exists() and len(restarted_journal.read_bytes().splitlines()) == 1  # the header alone


async def test_rows_keep_the_trace_and_recent_lists_newest_first(url):
    async with Ledger(url) as ledger:
        for i in range(3):
            await ledger.record(make_record(f"r{i}", finished_at=DAY1 + i,
                                            trace={"endpoint": "/v1/completions", "ttft_ms": 12.5 + i}))
        assert (await ledger.get("r1")).trace == {"endpoint": "/v1/completions", "ttft_ms": 13.5}
        assert [row.request_id for row in await ledger.recent(2)] == ["r2", "r1"]


async def test_a_ledger_from_before_traces_gains_the_column(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # the table as the first release created it
        conn.execute("""CREATE TABLE usage_ledger (
            request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
            prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
            cost_usd REAL NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL,
            stages_ms TEXT NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL)""")
        conn.execute("INSERT INTO usage_ledger VALUES ('old', 'k', 'm', 1, 0, 1, 0.0, 'stop', NULL, 200, "
                     "'{\"decode\": 1.0}', 1.0, 2.0)")
    async with Ledger(f"sqlite://{path}") as ledger:
        old = await ledger.get("old")
        assert old.trace == {} and old.stages_ms == {"decode": 1.0}
        await ledger.record(make_record("new", trace={"ttft_ms": 3.0}))
        assert (await ledger.get("new")).trace == {"ttft_ms": 3.0}
