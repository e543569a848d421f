"""Serving benchmark: a streaming async client against a real `tokenway serve`.

    python bench/serve_bench.py                 # starts a server, runs everything (~5 min)
    python bench/serve_bench.py --quick         # fewer requests
    python bench/serve_bench.py --base-url http://127.0.0.1:8000   # an already running server

For concurrency 1, 4 and 16 it reports request throughput, output tokens/s and TTFT, TPOT,
ITL and end-to-end latency at p50/p90/p99 (vLLM's definitions: TPOT = (e2e - ttft) /
(output tokens - 1); ITL = gaps between streamed chunks). Then a shared-prefix workload
(every prompt starts with the same 1,000-token system prompt), the engine's offline
throughput on the concurrency-16 requests (measured first, with no server running), and
/health latency while the engine is saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODEL = "smollm2-135m-instruct"


@dataclass
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


def make_requests(count: int, low: int, high: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        body = [rng.randrange(100, 49152) for _ in range(rng.randint(low, high))]
        prompts.append((prefix or []) + body)
    return prompts


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> Result:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result()
    started = time.perf_counter()
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            if last is None:
                result.ttft = now - started
            else:
                result.itl.append(now - last)
            last = now
    result.e2e = time.perf_counter() - started
    return result


async def run_load(base_url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   probe_health: bool = False) -> tuple[list[Result], float, list[float]]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        queue = list(prompts)
        results: list[Result] = []
        health: list[float] = []
        done = asyncio.Event()

        async def worker() -> None:
            while queue:
                results.append(await one_request(client, queue.pop(0), output_len))

        async def prober() -> None:
            async with httpx.AsyncClient(base_url=base_url, timeout=10) as probe:
                while not done.is_set():
                    started = time.perf_counter()
                    await probe.get("/health")
                    health.append(time.perf_counter() - started)
                    await asyncio.sleep(0.05)

        probe_task = asyncio.create_task(prober()) if probe_health else None
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        done.set()
        if probe_task:
            await probe_task
        return results, elapsed, health


def report(name: str, results: list[Result], elapsed: float) -> float:
    ms = lambda values, q: percentile(values, q) * 1000  # noqa: E731
    ttft = [r.ttft for r in results]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    itl = [gap for r in results for gap in r.itl]
    e2e = [r.e2e for r in results]
    tokens_per_s = sum(r.output_tokens for r in results) / elapsed
    print(f"{name}: {len(results) / elapsed:.2f} req/s, {tokens_per_s:.1f} output tok/s")
    for label, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)):
        print(f"    {label:5s} p50 {ms(values, 50):8.1f} ms   p90 {ms(values, 90):8.1f} ms   "
              f"p99 {ms(values, 99):8.1f} ms")
    return tokens_per_s


def offline_throughput(prompts: list[list[int]], output_len: int, max_num_seqs: int = 128) -> float:
    from tokenway import LLM, SamplingParams

    llm = LLM(MODEL, show_progress=False, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(temperature=0, max_tokens=4))
    llm.engine.kv_manager.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return len(prompts) * output_len / (time.perf_counter() - started)


def start_server(*extra: str, repo: Path = REPO, log=None) -> tuple[subprocess.Popen, str]:
    """`tokenway serve` from the checkout `repo` on a free loopback port with `extra` flags,
    once it is ready; its output to `log` (a file) if given."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "tokenway.cli", "serve", "--port", str(port),
                                "--log-level", "warning", *extra], cwd=repo,
                               env={**os.environ, "PYTHONPATH": str(repo)}, stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(base_url + "/ready", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    output_len = 64 if args.quick else 128
    per_level = {1: 4, 4: 8, 16: 32} if args.quick else {1: 8, 4: 16, 16: 64}
    workloads = {c: make_requests(n, 32, 256, seed=c) for c, n in per_level.items()}

    offline = offline16 = None
    if not args.base_url:
        offline = offline_throughput(workloads[16], output_len)
        offline16 = offline_throughput(workloads[16], output_len, max_num_seqs=16)
        print(f"engine offline on the concurrency-16 requests: {offline:.1f} output tok/s all at once, "
              f"{offline16:.1f} output tok/s 16 at a time (max_num_seqs=16)")
    process, base_url = (None, args.base_url) if args.base_url else start_server()
    try:
        asyncio.run(run_load(base_url, make_requests(2, 16, 16, seed=99), 8, 2))  # warm-up
        for concurrency, prompts in workloads.items():
            results, elapsed, health = asyncio.run(run_load(base_url, prompts, output_len, concurrency,
                                                            probe_health=concurrency == 16))
            served = report(f"concurrency {concurrency}", results, elapsed)
            if concurrency == 16:
                if offline:
                    print(f"    -> {100 * served / offline:.0f}% of the engine's offline throughput with every request "
                          f"at once, {100 * served / offline16:.0f}% of it 16 at a time (target >= 90%)")
                print(f"    /health while saturated: p50 {percentile(health, 50) * 1000:.1f} ms, "
                      f"p99 {percentile(health, 99) * 1000:.1f} ms over {len(health)} probes (target p99 < 20 ms)")
        prefix = make_requests(1, 1000, 1000, seed=7)[0]
        shared = make_requests(per_level[4], 16, 64, seed=8, prefix=prefix)
        results, elapsed, _ = asyncio.run(run_load(base_url, shared, output_len, 4))
        report("shared 1,000-token prefix, concurrency 4", results, elapsed)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


if __name__ == "__main__":
    main()
