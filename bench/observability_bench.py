"""What observability costs: throughput at concurrency 16 with traces + metrics on vs off.

    python bench/observability_bench.py            # ~4 min: 4 interleaved rounds per configuration
    python bench/observability_bench.py --quick    # 2 rounds

Three servers on the same model, started once and measured in turn, round after round (the
machine's noise hits all alike): `--no-observability`; the default (traces, /metrics and
the dashboard on, with /metrics scraped every second and the dashboard snapshot read every
2 s while the load runs, harsher than any real scraper); and the default plus OTLP export
to a collector on loopback. Each round: 32 streaming completions (prompts 32-256 random
tokens, 64 output tokens, ignore_eos) at concurrency 16. Prints tokens/s per round and the
median ratio to `off`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import REPO, make_requests, run_load, start_server  # noqa: E402


class NullCollector:
    """Accepts OTLP/HTTP posts and counts their bytes (decoding them is the collector's job, not ours)."""

    def __init__(self) -> None:
        collector = self
        self.num_bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                collector.num_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


async def scraper(base_url: str, stop: asyncio.Event) -> int:
    """Scrape /metrics every second and the dashboard snapshot every 2 s; returns the scrapes."""
    num_scrapes = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while not stop.is_set():
            (await client.get("/metrics")).raise_for_status()
            if num_scrapes % 2 == 0:
                (await client.get("/dashboard/api/snapshot")).raise_for_status()
            num_scrapes += 1
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    return num_scrapes


async def one_round(base_url: str, prompts: list[list[int]], output_len: int, scrape: bool) -> float:
    stop = asyncio.Event()
    scraping = asyncio.create_task(scraper(base_url, stop)) if scrape else None
    results, elapsed, _ = await run_load(base_url, prompts, output_len, concurrency=16)
    stop.set()
    if scraping is not None:
        await scraping
    return sum(r.output_tokens for r in results) / elapsed


def micro_costs() -> dict[str, float]:
    """The instrumentation's own CPU time, in process: per call, per token, per scrape."""
    sys.path.insert(0, str(REPO))
    from tokenway.gateway.policy import CallRecord
    from tokenway.gateway.stages import STAGES, StageClock
    from tokenway.observability.observer import Observer
    from tokenway.observability.traces import Trace

    stats = {"num_running": 16, "num_waiting": 0, "num_pending_http": 16, "kv_blocks_total": 5825,
             "kv_blocks_free": 5000, "prefix_cache_hit_rate": 0.1, "prefix_cache_queried_tokens": 10_000,
             "prefix_cache_hit_tokens": 1_000, "num_preemptions": 0}
    observer = Observer(lambda: stats)
    clock = StageClock()
    for stage in STAGES[:-1]:
        clock.end(stage)
    clock.start_billing()
    clock.finish()
    n = 2000
    records = [CallRecord(request_id=f"cmpl-{i}", endpoint="/v1/completions", model="m", prompt_tokens=100,
                          completion_tokens=64, max_choice_tokens=64, finish_reason="length") for i in range(n)]
    started = time.perf_counter()
    for record in records:
        observer.record(Trace.of_call(record, clock, 200))
    per_call = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(20 * n):
        observer.on_tokens("m", 1, 0.04)
    per_token = (time.perf_counter() - started) / (20 * n)
    started = time.perf_counter()
    for _ in range(50):
        observer.metrics.exposition()
    per_scrape = (time.perf_counter() - started) / 50
    started = time.perf_counter()
    for _ in range(50):
        json.dumps(observer.snapshot(50))
    per_snapshot = (time.perf_counter() - started) / 50
    return {"call": per_call, "token": per_token, "scrape": per_scrape, "snapshot": per_snapshot}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    cost = micro_costs()
    print(f"instrumentation CPU time in process: {cost['call'] * 1e6:.1f} µs per call (trace, ring, metrics), "
          f"{cost['token'] * 1e6:.2f} µs per token (inter-token histogram), {cost['scrape'] * 1e3:.2f} ms per "
          f"/metrics scrape, {cost['snapshot'] * 1e3:.2f} ms per dashboard snapshot (2,000 traces in the ring)")
    output_len = 64
    collector = NullCollector()
    configs = {"off": ("--no-observability",), "on": (), "on+otlp": ("--otlp-endpoint", collector.endpoint)}
    data_dir = REPO / ".cache" / "bench"
    data_dir.mkdir(parents=True, exist_ok=True)
    servers = {name: start_server("--db", str(data_dir / f"observability-{name}.db"), *extra)
               for name, extra in configs.items()}
    try:
        warmup = make_requests(16, 32, 256, seed=99)
        for _, base_url in servers.values():
            asyncio.run(one_round(base_url, warmup, 16, scrape=False))
        tokens_per_s: dict[str, list[float]] = {name: [] for name in configs}
        for round_index in range(rounds):
            # Fresh prompts each round (no prefix-cache hits across rounds), the same for every config.
            prompts = make_requests(32, 32, 256, seed=1000 + round_index)
            for name, (_, base_url) in servers.items():
                value = asyncio.run(one_round(base_url, prompts, output_len, scrape=name != "off"))
                tokens_per_s[name].append(value)
                print(f"round {round_index + 1} {name:8s} {value:7.1f} output tok/s", flush=True)
        off = statistics.median(tokens_per_s["off"])
        # What the load above costs the event loop per second, from the in-process figures.
        requests_per_s = off / output_len
        busy = requests_per_s * cost["call"] + off * cost["token"] + cost["scrape"] + cost["snapshot"] / 2
        print(f"\nat {off:.0f} tok/s ({requests_per_s:.1f} calls/s) with /metrics scraped every 1 s and the dashboard "
              f"every 2 s, the instrumentation needs {busy * 1e3:.2f} ms of CPU per second ({busy:.2%} of one core)")
        print(f"\nconcurrency 16, {rounds} rounds x 32 requests x {output_len} tokens (median of rounds):")
        for name, values in tokens_per_s.items():
            median = statistics.median(values)
            print(f"  {name:8s} {median:7.1f} tok/s  ({median / off:6.1%} of off; rounds "
                  f"{', '.join(f'{v:.1f}' for v in values)})")
        print(f"  OTLP bytes received by the collector: {collector.num_bytes}")
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            process.wait(60)


if __name__ == "__main__":
    main()
