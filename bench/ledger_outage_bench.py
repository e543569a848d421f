"""The usage ledger through a PostgreSQL outage: how soon the running ledger has committed what
waited, and what it cost while it waited.

    python bench/ledger_outage_bench.py                      # 40 s outage at 50 rows/s, as reported
    python bench/ledger_outage_bench.py --outage-s 10 --rate 500

A PostgreSQL of its own (scripts/postgres.sh on a free port, in a temp directory) is stopped while
a journaled Ledger records at --rate rows/s, then started again. Prints: rows recorded during the
outage, connection attempts the writer made meanwhile, the spend a key shows during the outage
against what it recorded, and the time from the server being up again to the ledger healthy and
every row committed (exactly once, checked).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402

import tokenway.billing.writer as writer_module  # noqa: E402
from tokenway.billing.ledger import Ledger, UsageRecord  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_record(i: int) -> UsageRecord:
    now = time.time()
    return UsageRecord(f"bench-{uuid.uuid4().hex}", f"key-{i % 20}", "smollm2-135m-instruct", 812, 512, 128, 0.0003,
                       "stop", None, 200, {"queue": 0.05, "prefill": 31.0, "decode": 402.5}, now - 0.43, now)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "TOKENWAY_PG_DIR": f"{scratch}/pg", "TOKENWAY_PG_PORT": str(free_port())}

        def postgres(command: str) -> str:
            script = REPO / "scripts" / "postgres.sh"
            return subprocess.run([script, command], env=env, check=True, capture_output=True, text=True).stdout.strip()

        url = postgres("start")
        num_connects = 0
        real_open_store = writer_module.open_store

        def counting_open_store(store_url: str):
            nonlocal num_connects
            num_connects += 1
            return real_open_store(store_url)

        writer_module.open_store = counting_open_store
        try:
            ledger = Ledger(url, journal_dir=f"{scratch}/journal")
            recorded: list[UsageRecord] = []

            async def record_for(seconds: float) -> None:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    rec = make_record(len(recorded))
                    await ledger.record(rec)
                    recorded.append(rec)
                    await asyncio.sleep(1 / args.rate)

            for i in range(20):
                await ledger.spend_usd(f"key-{i}")
            await record_for(1.0)
            await asyncio.to_thread(postgres, "stop")
            num_before, connects_before = len(recorded), num_connects
            await record_for(args.outage_s)
            spend = sum([await ledger.spend_usd(f"key-{i}") for i in range(20)])
            health = ledger.health()
            print(f"outage {args.outage_s:.0f} s at {args.rate:.0f} rows/s: {len(recorded) - num_before} rows "
                  f"recorded, {health.num_pending_rows} pending, writer connected {num_connects - connects_before} "
                  "times")
            print(f"spend during the outage ${spend:.4f}, recorded ${sum(r.cost_usd for r in recorded):.4f}")
            await asyncio.to_thread(postgres, "start")
            up_at = time.monotonic()
            while ledger.health().degraded or ledger.health().num_pending_rows:
                await asyncio.sleep(0.01)
            caught_up_s = time.monotonic() - up_at
            with psycopg.connect(url) as conn:
                num_rows, num_distinct = conn.execute(
                    "SELECT COUNT(*), COUNT(DISTINCT request_id) FROM usage_ledger").fetchone()
            assert num_rows == num_distinct == len(recorded), (num_rows, num_distinct, len(recorded))
            print(f"server up -> every row committed: {caught_up_s:.2f} s ({num_rows} rows, each once; "
                  f"journal {ledger.journal_path.stat().st_size} bytes)")
            await ledger.close()
        finally:
            writer_module.open_store = real_open_store
            postgres("stop")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage-s", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=50.0)
    asyncio.run(main(parser.parse_args()))
