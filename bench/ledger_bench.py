"""Usage-ledger benchmark: what record() costs the request path, for SQLite and PostgreSQL.

    python bench/ledger_bench.py                   # both backends (starts scripts/postgres.sh)
    python bench/ledger_bench.py --backends sqlite --seconds 5

For each backend:
  throughput  rows/s with 1,000 concurrent callers looping on `await record()`, and commits per
              row; the peer is the same ledger with batch_max=1 (a commit per row).
  latency     record() p50/p99 at an open-loop 300 records/s (a record is started every 3.3 ms
              whether or not earlier ones returned), for max_delay_s 0 (commit as soon as the
              writer is free) and 2 ms (linger for batch-mates).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenway.billing.ledger import Ledger, UsageRecord  # noqa: E402  (after the sys.path line)


def make_record(request_id: str) -> UsageRecord:
    now = time.time()
    return UsageRecord(request_id, f"key-{hash(request_id) % 50}", "smollm2-135m-instruct", 812, 512, 128, 0.000123,
                       "stop", None, 200,
                       {"auth": 0.04, "validation": 0.37, "tokenize": 0.22, "queue": 0.05, "prefill": 31.0,
                        "decode": 402.5, "postprocess": 0.12}, now - 0.43, now)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def throughput(url: str, num_rows: int, batch_max: int) -> tuple[float, int]:
    async with Ledger(url, batch_max=batch_max) as ledger:
        request_ids = [uuid.uuid4().hex for _ in range(num_rows)]

        async def caller(ids: list[str]) -> None:
            for request_id in ids:
                await ledger.record(make_record(request_id))

        start = time.perf_counter()
        await asyncio.gather(*(caller(request_ids[i::1000]) for i in range(1000)))
        elapsed = time.perf_counter() - start
        return num_rows / elapsed, ledger.num_commits


async def latency(url: str, rate: float, seconds: float, max_delay_s: float) -> tuple[float, float, float]:
    async with Ledger(url, max_delay_s=max_delay_s) as ledger:
        latencies: list[float] = []

        async def one() -> None:
            start = time.perf_counter()
            await ledger.record(make_record(uuid.uuid4().hex))
            latencies.append(time.perf_counter() - start)

        num_records = int(rate * seconds)
        tasks = []
        t0 = time.perf_counter()
        for i in range(num_records):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3, num_records / ledger.num_commits


async def bench(name: str, url: str, args: argparse.Namespace) -> None:
    rows_per_s, num_commits = await throughput(url, args.rows, batch_max=256)
    peer_rows_per_s, _ = await throughput(url, args.rows // 10, batch_max=1)
    print(f"{name:10s} throughput: {rows_per_s:8.0f} rows/s ({args.rows / num_commits:.0f} rows/commit);"
          f" a commit per row: {peer_rows_per_s:6.0f} rows/s")
    for max_delay_s in (0.0, 0.002):
        p50, p99, rows_per_commit = await latency(url, args.rate, args.seconds, max_delay_s)
        print(f"{name:10s} record() at {args.rate:.0f}/s, max_delay_s={max_delay_s}: p50 {p50:.3f} ms,"
              f" p99 {p99:.3f} ms ({rows_per_commit:.1f} rows/commit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if "sqlite" in args.backends:
            asyncio.run(bench("sqlite", f"sqlite://{tmp}/ledger.db", args))
        if "postgresql" in args.backends:
            import psycopg

            script = str(REPO / "scripts" / "postgres.sh")
            server_url = subprocess.run([script, "start"], check=True, capture_output=True, text=True).stdout.strip()
            name = f"ledger_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(server_url, autocommit=True) as admin:
                admin.execute(f"CREATE DATABASE {name}")
            try:
                asyncio.run(bench("postgresql", server_url.rsplit("/", 1)[0] + "/" + name, args))
            finally:
                with psycopg.connect(server_url, autocommit=True) as admin:
                    admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
