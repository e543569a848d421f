"""Limiter benchmark: the latency of one admit + reconcile, per backend.

    python bench/limits_bench.py            # in-process and Redis (started by scripts/redis.sh)
    python bench/limits_bench.py --quick    # fewer calls

For each backend: admit + reconcile of one request, one at a time (the latency a request sees
on an idle gateway) and with 64 in flight at once (under load), at p50/p99, with every limit
set and never reached, on 100 keys. The peer for Redis is a plain PING round trip on the same
connection pool, measured in the same run: what Redis costs before any script runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenway.gateway.limits import InProcessLimiter, Limiter, LimitSpec  # noqa: E402  (after the sys.path line)

SPEC = LimitSpec(rpm=10**6, tpm=10**9, tpd=10**10, max_concurrent=10**4)
NUM_KEYS = 100


def percentiles_ms(latencies_s: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(latencies_s, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


async def one_request(limiter: Limiter, i: int) -> float:
    start = time.perf_counter()
    decision = await limiter.admit(f"bench-{i % NUM_KEYS}", SPEC, 600)
    assert decision.allowed, decision
    await limiter.reconcile(decision.reservation, 200)
    return time.perf_counter() - start


async def measure(limiter: Limiter, num_calls: int, concurrency: int) -> tuple[list[float], float]:
    """Latencies of num_calls admit + reconcile pairs, at most `concurrency` at once; and calls/s."""
    semaphore, latencies = asyncio.Semaphore(concurrency), []

    async def bounded(i: int) -> None:
        async with semaphore:
            latencies.append(await one_request(limiter, i))

    for i in range(min(200, num_calls)):  # warm-up: connections, script load, key state
        await one_request(limiter, i)
    start = time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(num_calls)))
    return latencies, num_calls / (time.perf_counter() - start)


async def ping_latencies(url: str, num_calls: int) -> list[float]:
    from redis.asyncio import Redis

    client, latencies = Redis.from_url(url), []
    for _ in range(num_calls):
        start = time.perf_counter()
        await client.ping()
        latencies.append(time.perf_counter() - start)
    await client.aclose()
    return latencies


async def run(backend: str, limiter: Limiter, num_calls: int) -> None:
    for concurrency in (1, 64):
        latencies, rate = await measure(limiter, num_calls, concurrency)
        p50, p99 = percentiles_ms(latencies)
        print(f"{backend:<11} {concurrency:>4}  {p50:8.3f}  {p99:8.3f}  {rate:9.0f}")
    await limiter.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    num_calls = 1000 if parser.parse_args().quick else 10_000

    redis_sh = REPO / "scripts" / "redis.sh"
    was_running = subprocess.run([redis_sh, "url"], check=False, capture_output=True).returncode == 0
    url = subprocess.run([redis_sh, "start"], check=True, capture_output=True, text=True).stdout.strip()
    try:
        from tokenway.gateway.limits_redis import RedisLimiter

        print(f"admit + reconcile, {num_calls} per row; ms")
        print(f"{'backend':<11} {'conc':>4}  {'p50':>8}  {'p99':>8}  {'calls/s':>9}")
        asyncio.run(run("in-process", InProcessLimiter(), num_calls))
        asyncio.run(run("redis", RedisLimiter(url), num_calls))
        p50, p99 = percentiles_ms(asyncio.run(ping_latencies(url, num_calls)))
        print(f"{'redis PING':<11} {1:>4}  {p50:8.3f}  {p99:8.3f}   (the peer: one round trip, no script)")
    finally:
        if not was_running:
            subprocess.run([redis_sh, "stop"], check=True)


if __name__ == "__main__":
    main()
