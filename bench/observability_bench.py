"""What observability costs: throughput at concurrency 16 with traces + metrics on vs off.

    python bench/observability_bench.py            # ~6 min: 4 rounds of every run
    python bench/observability_bench.py --rounds 8

Four servers on the same model, started once, one per run (so no run hits a prefix cache
another run filled), measured in turn round after round in an order that rotates each
round: `off` (`--no-observability`); `on` (the default: traces, metrics, dashboard; /metrics
scraped every 5 s); `on+dashboard` (/metrics every 1 s and the dashboard snapshot every 2 s,
what an open dashboard costs); `on+otlp` (OTLP export to a collector on loopback).
Each round: 32 streaming completions (prompts 32-256 random tokens, 64 output tokens,
ignore_eos) at concurrency 16. Prints tokens/s per round, the ratio of medians to `off` and
the median of the per-round ratios (rounds share the machine's noise), and the
instrumentation's CPU time measured in process.
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


async def scraper(base_url: str, stop: asyncio.Event, every_s: float, dashboard: bool) -> int:
    """Scrape /metrics every `every_s` (and, with `dashboard`, the dashboard snapshot every
    other time, as the page does); returns the number of scrapes."""
    num_scrapes = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while not stop.is_set():
            (await client.get("/metrics")).raise_for_status()
            if dashboard and num_scrapes % 2 == 0:
                (await client.get("/dashboard/api/snapshot")).raise_for_status()
            num_scrapes += 1
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass
    return num_scrapes


async def one_round(base_url: str, prompts: list[list[int]], output_len: int, scrape_every_s: float | None,
                    dashboard: bool) -> float:
    stop = asyncio.Event()
    scraping = None
    if scrape_every_s is not None:
        scraping = asyncio.create_task(scraper(base_url, stop, scrape_every_s, dashboard))
    results, elapsed, _ = await run_load(base_url, prompts, output_len, concurrency=16)
    stop.set()
    if scraping is not None:
        await scraping
    return sum(r.output_tokens for r in results) / elapsed


def micro_costs() -> dict[str, float]:
    """The instrumentation's own CPU time, in process: per call, per token, per scrape."""
    sys.path.insert(0, str(REPO))
    from tokenway.engine.stats import EngineStats
    from tokenway.gateway.call import Call, CallOutcome, CallStart, RouteChoice
    from tokenway.observability.observer import Observer
    from tokenway.observability.traces import Trace
    from tokenway.server.stats import ServerStats
    from tokenway.stages import STAGES, StageClock

    engine = EngineStats(num_running=16, num_waiting=0, kv_blocks_total=5825, kv_blocks_free=5000,
                         prefix_cache_hit_rate=0.1, prefix_cache_queried_tokens=10_000, prefix_cache_hit_tokens=1_000,
                         num_preemptions=0, num_steps=0, spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                         spec_decode_num_accepted_tokens=0, spec_decode_acceptance_rate=0.0,
                         spec_decode_mean_accepted_length=0.0)
    stats = ServerStats(engine, num_pending_http=16, replicas={})
    observer = Observer(lambda: stats)
    clock = StageClock()
    for stage in STAGES[:-1]:
        clock.end(stage)
    clock.start_billing()
    clock.finish()
    n = 2000
    calls = []
    for _ in range(n):
        call = Call(CallStart.now("/v1/completions"), clock)
        call.set_route(RouteChoice(model="m", pool="m"))
        calls.append(call)
    outcome = CallOutcome(200, prompt_tokens=100, completion_tokens=64, max_choice_tokens=64, finish_reason="length")
    started = time.perf_counter()
    for call in calls:
        observer.record(Trace.of_call(call, outcome))
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
    # One server per run: a run on a server that already saw the round's prompts would hit its prefix cache.
    server_flags = {"off": ("--no-observability",), "on": (), "on+dashboard": (),
                    "on+otlp": ("--otlp-endpoint", collector.endpoint)}
    # run name -> (server, seconds between /metrics scrapes or None, read the dashboard too)
    runs = {"off": ("off", None, False), "on": ("on", 5.0, False), "on+dashboard": ("on+dashboard", 1.0, True),
            "on+otlp": ("on+otlp", 5.0, False)}
    data_dir = REPO / ".cache" / "bench"
    data_dir.mkdir(parents=True, exist_ok=True)
    servers = {name: start_server("--db", str(data_dir / f"observability-{name}.db"), "--kv-cache-memory", "1GiB",
                                  *extra)
               for name, extra in server_flags.items()}
    try:
        warmup = make_requests(16, 32, 256, seed=99)
        for _, base_url in servers.values():
            asyncio.run(one_round(base_url, warmup, 16, None, False))
        tokens_per_s: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for round_index in range(rounds):
            # Fresh prompts each round (no prefix-cache hits across rounds), the same for every run;
            # the order rotates so that no configuration always goes first.
            prompts = make_requests(32, 32, 256, seed=1000 + round_index)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                server, scrape_every, dashboard = runs[name]
                value = asyncio.run(one_round(servers[server][1], prompts, output_len, scrape_every, dashboard))
                tokens_per_s[name].append(value)
                print(f"round {round_index + 1} {name:13s} {value:7.1f} output tok/s", flush=True)
        off = statistics.median(tokens_per_s["off"])
        # What the load above costs the event loop per second, from the in-process figures.
        requests_per_s = off / output_len
        busy = requests_per_s * cost["call"] + off * cost["token"] + cost["scrape"] + cost["snapshot"] / 2
        print(f"\nat {off:.0f} tok/s ({requests_per_s:.1f} calls/s) with /metrics scraped every 1 s and the dashboard "
              f"every 2 s, the instrumentation needs {busy * 1e3:.2f} ms of CPU per second ({busy:.2%} of one core)")
        print(f"\nconcurrency 16, {rounds} rounds x 32 requests x {output_len} tokens; 'paired' is the median over "
              "rounds of this run / off in the same round:")
        for name, values in tokens_per_s.items():
            median = statistics.median(values)
            paired = statistics.median(v / o for v, o in zip(values, tokens_per_s["off"]))
            print(f"  {name:13s} {median:7.1f} tok/s  median {median / off:6.1%} of off, paired {paired:6.1%}; rounds "
                  f"{', '.join(f'{v:.1f}' for v in values)}")
        print(f"  OTLP bytes received by the collector: {collector.num_bytes}")
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            process.wait(60)


if __name__ == "__main__":
    main()
