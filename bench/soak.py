"""Soak: steady streaming load for a given time; the server's memory and throughput each minute.

    python bench/soak.py                       # 30 minutes after a 3-minute warm-up, 8 clients
    python bench/soak.py --minutes 5 --warmup 1 --clients 4

Each client streams chat completions back to back (a prompt drawn from a few hundred
distinct ones, 64 tokens out by default, ignore_eos), as a steady production load does: prefix-cache
hits and misses, new and repeated texts, every request traced and billed. Each minute it
prints the server's RSS (its own, and its children's: the body parser), the output tokens/s
and requests of that minute. At the end: RSS growth from the first minute after warm-up to
the last, and RSS after a minute idle (is memory returned?).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import MODEL, start_server  # noqa: E402

WORDS = ("alpha beta gamma delta tokens cache river mountain engine ledger stream budget model prompt window "
         "request answer question tell story about history science music").split()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def children_rss_mib(pid: int) -> float:
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    for child in children:
        try:
            total += rss_mib(int(child)) + children_rss_mib(int(child))
        except OSError:
            pass
    return total


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(count)]


async def client_loop(base_url: str, texts: list[str], seed: int, max_tokens: int, counters: dict,
                      stop: asyncio.Event) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        while not stop.is_set():
            body = {"model": MODEL, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.8,
                    "messages": [{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": rng.choice(texts)}],
                    "stream_options": {"include_usage": True}}
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"usage":{' in line:
                            usage = json.loads(line[6:]).get("usage")
                            if usage:
                                counters["tokens"] += usage["completion_tokens"]
                counters["requests"] += 1 if response.status_code == 200 else 0
                counters["errors"] += 0 if response.status_code == 200 else 1
            except httpx.HTTPError:
                counters["errors"] += 1


async def soak(base_url: str, pid: int, minutes: float, warmup: float, num_clients: int, max_tokens: int) -> None:
    texts = prompts(400, seed=1)
    counters = {"tokens": 0, "requests": 0, "errors": 0}
    stop = asyncio.Event()
    clients = [asyncio.create_task(client_loop(base_url, texts, seed, max_tokens, counters, stop))
               for seed in range(num_clients)]
    print(f"warm-up {warmup:g} min, then {minutes:g} min at {num_clients} streaming clients, {max_tokens} tokens out")
    print(f"{'minute':>6} {'RSS MiB':>9} {'children':>9} {'tok/s':>8} {'requests':>9} {'errors':>7}")
    samples = []
    started = time.monotonic()
    total = warmup + minutes
    for minute in range(1, int(total) + 1):
        before = dict(counters)
        await asyncio.sleep(max(0.0, started + 60 * minute - time.monotonic()))
        rss, children = rss_mib(pid), children_rss_mib(pid)
        tokens_per_s = (counters["tokens"] - before["tokens"]) / 60
        mark = " (warm-up)" if minute <= warmup else ""
        num_requests, num_errors = counters["requests"] - before["requests"], counters["errors"] - before["errors"]
        print(f"{minute:>6} {rss:>9.0f} {children:>9.0f} {tokens_per_s:>8.1f} {num_requests:>9} {num_errors:>7}{mark}",
              flush=True)
        if minute > warmup:
            samples.append(rss)
    stop.set()
    await asyncio.gather(*clients)
    await asyncio.sleep(60)
    idle = rss_mib(pid)
    first, last = samples[0], samples[-1]
    print(f"\nRSS after warm-up {first:.0f} MiB -> after {len(samples)} min {last:.0f} MiB: "
          f"{100 * (last - first) / first:+.1f}% (peak {max(samples):.0f} MiB); after 1 min idle {idle:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (fewer: more requests per minute)")
    parser.add_argument("--base-url", help="an already running server (then --pid is its process id)")
    parser.add_argument("--pid", type=int)
    args = parser.parse_args()
    if args.base_url:
        asyncio.run(soak(args.base_url, args.pid, args.minutes, args.warmup, args.clients, args.max_tokens))
        return
    with tempfile.TemporaryDirectory() as workdir:
        process, base_url = start_server("--db", str(Path(workdir) / "soak.db"))
        try:
            asyncio.run(soak(base_url, process.pid, args.minutes, args.warmup, args.clients, args.max_tokens))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(120)


if __name__ == "__main__":
    main()
