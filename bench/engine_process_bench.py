"""The engine in its own process against the engine thread, alternated on the same machine:
output tok/s at 16 streams, engine steps, and /health latency while the server is saturated.

    python bench/engine_process_bench.py                     # 3 rounds of: thread, process
    python bench/engine_process_bench.py --rounds 4 --modes process process-nice5 thread
    python bench/engine_process_bench.py --shared-prefix-words 800 --max-tokens 128   # the peers' shared workload

Each mode starts `tokenway serve` (no embeddings), warms it with 16 requests, then runs the
load (N requests, C at a time, `--max-tokens` each, ignore_eos) while a probe asks /health every
50 ms. Runs alternate modes, so the machine's drift (±15-25% here within minutes) hits each alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODE_FLAGS = {"thread": "--engine-thread", "process": "", "process-nice5": "--engine-niceness 5",
              "process-nice10": "--engine-niceness 10"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARED_PREFIX_SENTENCE = "The keeper of the lighthouse wrote down the weather, the ships and the tides. "


def prompt_of(number: int, shared_prefix_words: int) -> str:
    """A short prompt, or (with a shared prefix) the same long preamble then a tail of its own."""
    if not shared_prefix_words:
        return "Write a long story about a lighthouse keeper."
    words = SHARED_PREFIX_SENTENCE.split()
    preamble = " ".join(words[i % len(words)] for i in range(shared_prefix_words))
    return f"{preamble}\nStory number {number}: write a long story about a lighthouse keeper."


async def one_request(client: httpx.AsyncClient, max_tokens: int, prompt: str) -> tuple[int, float | None]:
    """(completion tokens, seconds per output token after the first)."""
    body = {"model": "smollm2-135m-instruct", "prompt": prompt,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens, first, last = 0, None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"completion_tokens"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return tokens, tpot


async def load(base_url: str, num_requests: int, concurrency: int, max_tokens: int,
               shared_prefix_words: int = 0) -> tuple[float, int, list[float]]:
    """(seconds, completion tokens, each request's TPOT) of the whole load."""
    queue = list(range(num_requests))
    total, tpots = 0, []

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal total
        while queue:
            number = queue.pop()
            tokens, tpot = await one_request(client, max_tokens, prompt_of(number, shared_prefix_words))
            total += tokens  # not `total += await ...`: that reads total first
            if tpot is not None:
                tpots.append(tpot)

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - started, total, tpots


async def probe_health(base_url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            started = time.perf_counter()
            await client.get("/health")
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.05)
    return latencies


async def measure(base_url: str, args) -> dict:
    await load(base_url, 16, 16, 16, args.shared_prefix_words)  # warm: kernels, caches, the first batches
    steps_before = httpx.get(f"{base_url}/engine/stats").json().get("num_steps", 0)
    stop = asyncio.Event()
    prober = asyncio.create_task(probe_health(base_url, stop))
    seconds, tokens, tpots = await load(base_url, args.num_requests, args.concurrency, args.max_tokens,
                                        args.shared_prefix_words)
    stop.set()
    latencies = sorted(await prober)
    steps = httpx.get(f"{base_url}/engine/stats").json().get("num_steps", 0) - steps_before
    tpots.sort()
    return {"tok_s": tokens / seconds, "steps": steps, "tpot_ms": 1000 * tpots[len(tpots) // 2] if tpots else 0.0,
            "health_p50": latencies[len(latencies) // 2],
            "health_p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], "n": len(latencies)}


def run_mode(flags: str, args) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "tokenway.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--no-embeddings", "--no-gateway", *shlex.split(flags)]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the server ({flags or 'defaults'}) did not become ready")
            time.sleep(0.5)
        return asyncio.run(measure(base_url, args))
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["thread", "process"], choices=sorted(MODE_FLAGS),
                        help="process: tokenway serve's default; thread: --engine-thread; "
                             "process-nice5: --engine-niceness 5")
    parser.add_argument("-n", "--num-requests", type=int, default=96)
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shared-prefix-words", type=int, default=0,
                        help="every prompt starts with the same N words (the peers' shared workload: ~1,000)")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for round_number in range(args.rounds):
        for mode in args.modes:
            result = run_mode(MODE_FLAGS[mode], args)
            results[mode].append(result)
            print(f"round {round_number + 1} [{mode}] {result['tok_s']:.1f} tok/s, "
                  f"TPOT p50 {result['tpot_ms']:.1f} ms, {result['steps']} steps, "
                  f"/health p50 {result['health_p50']:.1f} ms p99 {result['health_p99']:.1f} ms (n={result['n']})",
                  flush=True)
    for mode, runs in results.items():
        tok_s = sorted(r["tok_s"] for r in runs)
        p99 = sorted(r["health_p99"] for r in runs)
        tpot = sorted(r["tpot_ms"] for r in runs)
        print(f"[{mode}] tok/s {tok_s[0]:.0f}-{tok_s[-1]:.0f} (median {tok_s[len(tok_s) // 2]:.0f}); "
              f"TPOT p50 {tpot[0]:.1f}-{tpot[-1]:.1f} ms; "
              f"/health p99 {p99[0]:.1f}-{p99[-1]:.1f} ms (median {p99[len(p99) // 2]:.1f})")


if __name__ == "__main__":
    main()
