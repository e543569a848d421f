"""The batch store's queue operations on a large backlog: what a runner's claim, a progress read
(get_batch) and a line's finish cost, on SQLite and on PostgreSQL.

    python bench/batch_store_bench.py                              # SQLite in a temp file
    python bench/batch_store_bench.py --url "$(scripts/postgres.sh url)" --lines 20000

A claim walks the undone lines' index of the oldest batch and stops at what it takes, so it
must not grow with the backlog; get_batch counts the batch's lines (a GROUP BY over its range).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from tokenway.batches import LineOutcome, new_batch, open_batch_store


def percentiles(samples: list[float]) -> str:
    samples = sorted(samples)
    return (f"p50 {1e3 * statistics.median(samples):6.2f} ms   "
            f"p90 {1e3 * samples[int(0.9 * (len(samples) - 1))]:6.2f} ms")


async def main(url: str, num_batches: int, num_lines: int, num_claims: int, claim_size: int) -> None:
    store = open_batch_store(url)
    try:
        start = time.perf_counter()
        now = time.time()
        body = {"model": "m", "messages": [{"role": "user", "content": "a question of some sixty words " * 8}]}
        batch_ids = []
        for k in range(num_batches):
            batch = await store.create_batch(new_batch("openai", "key", "/v1/chat/completions", now=now + k),
                                             [(f"c{i}", body) for i in range(num_lines)])
            batch_ids.append(batch.id)
        print(f"{url.split('@')[-1]}: {num_batches} batches x {num_lines} lines made in "
              f"{time.perf_counter() - start:.2f} s")
        claims, finishes = [], []
        outcome = LineOutcome("succeeded", 200, {"id": "chatcmpl-1", "choices": []}, None, "req_1")
        for _ in range(num_claims):
            t0 = time.perf_counter()
            lines = await store.claim("bench", claim_size, 600, time.time())
            claims.append(time.perf_counter() - t0)
            for line in lines[:4]:
                t0 = time.perf_counter()
                await store.finish("bench", line, outcome)
                finishes.append(time.perf_counter() - t0)
        reads = []
        for _ in range(20):
            t0 = time.perf_counter()
            await store.get_batch(batch_ids[0], "key")
            reads.append(time.perf_counter() - t0)
        print(f"claim({claim_size})   {percentiles(claims)}")
        print(f"finish      {percentiles(finishes)}")
        print(f"get_batch   {percentiles(reads)}   ({num_lines} lines counted)")
    finally:
        await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="the database (default: SQLite in a temp file)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--claims", type=int, default=50)
    parser.add_argument("--claim-size", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(main(args.url or f"sqlite://{directory}/ledger.db", args.batches, args.lines, args.claims,
                         args.claim_size))
