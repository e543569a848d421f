"""Gateway benchmark: what auth, limits, budgets and the usage ledger add to a request, open loop.

    python bench/gateway_bench.py            # 10 s per run, 2 repeats (~12 min)
    python bench/gateway_bench.py --quick    # 3 s per run (~5 min)
    python bench/gateway_bench.py --quick --configs memory,budget --baseline /path/to/other/checkout
    python bench/gateway_bench.py --configs redis,redis_budget --rates 10,100 --baseline /path/to/other/checkout

Fresh `tokenway serve` processes, alive side by side: off (--no-gateway), on with in-process
limits (memory), on with Redis limits (redis, a private redis-server), and the same two with a
budget on the key and a price on the model (budget, redis_budget: every call also reserves its
worst-case cost and settles it). The on servers have one API key with limits (and a budget) far
above the load, so every request is authenticated, admitted by reservation, reconciled and
written to the SQLite ledger (group commit), and none is refused. --baseline adds, for each
configuration run but off, the same served from another checkout (the code before a change:
memory@base, redis_budget@base...), run in alternation with the others, so before and after
meet the same machine at the same moments.

Each run sends POST /v1/completions with one prompt token and max_tokens=1 on a fixed schedule
(open loop: a slow response never delays the next send) at one rate for a fixed time. Latency
runs from the scheduled send time, so client lag counts against the server, as in wrk2. Errors
are non-200 responses and timeouts (no response 2 s after the scheduled send). At each rate the
configurations run in alternation (off, memory, redis, off, memory, redis, ...), each run
starting once the previous server is idle; each figure is the median over repeats. Rates rise
until every configuration has >= 1% errors or a p99 over 1 s.

Besides client latency, each response's Server-Timing header splits the server's time:
    gw     the `auth`, `validation` and `routing` stages: key check, body read and parse, model
           check (under load it also holds the wait for the event loop to deliver the body)
    admit  the `limits` stage: budget and the limiter's reservation
    srv    the server's own total as of the response being built (Server-Timing)
    out    client time minus srv: HTTP both ways, the client, and the ledger commit (`billing`),
           which the middleware awaits after the response is built and before its last byte
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "prompt": [1234], "max_tokens": 1, "temperature": 0}
CONFIGS = ("off", "memory", "budget", "redis", "redis_budget")
# What a budget configuration's extra cost is measured against: the same without the budget.
BUDGET_TO_PLAIN = {"budget": "memory", "redis_budget": "redis"}
BASE = "@base"  # the suffix of a configuration served from --baseline's checkout
# Prices for the budget configurations (USD per million tokens), so the reservations are not zero.
PRICES_TOML = f'[prices."{MODEL}"]\ninput = 0.15\ncached_input = 0.075\noutput = 0.6\n'
BLOWN_P99_S = 1.0  # a rate where every configuration's p99 passes this (or errors >= 1%) is the last
TIMEOUT_S = 2.0  # from the scheduled send time: 100x a lone request's latency


@dataclass(slots=True)
class Sample:
    """One request. latency_s runs from its scheduled send time, e2e_s from its actual one."""

    error: str | None  # None: a 200; else the status code or the exception's class
    latency_s: float
    e2e_s: float
    lag_s: float
    stage_to_ms: dict[str, float]


@dataclass(slots=True)
class RunStats:
    """One configuration at one rate, one repeat; times in ms."""

    num_requests: int
    error_pct: float
    error_to_count: Counter[str]
    p50: float
    p99: float
    gw_p50: float
    gw_p99: float
    admit_p50: float
    admit_p99: float
    srv_p50: float
    out_p50: float
    lag_p99: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def parse_server_timing(header: str) -> dict[str, float]:
    """`auth;dur=0.04, validation;dur=0.22, ...` -> {"auth": 0.04, "validation": 0.22, ...}."""
    stage_to_ms = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            stage_to_ms[name] = float(dur)
    return stage_to_ms


def summarize(samples: list[Sample]) -> RunStats:
    ok = [s for s in samples if s.error is None]

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000

    def stage(*names: str) -> list[float]:
        return [sum(s.stage_to_ms.get(name, float("nan")) for name in names) / 1000 for s in ok]

    return RunStats(
        num_requests=len(samples),
        error_pct=100 * (len(samples) - len(ok)) / max(1, len(samples)),
        error_to_count=Counter(s.error for s in samples if s.error is not None),
        p50=ms([s.latency_s for s in ok], 50), p99=ms([s.latency_s for s in ok], 99),
        gw_p50=ms(stage("auth", "validation", "routing"), 50), gw_p99=ms(stage("auth", "validation", "routing"), 99),
        admit_p50=ms(stage("limits"), 50), admit_p99=ms(stage("limits"), 99),
        srv_p50=ms(stage("total"), 50),
        out_p50=ms([s.e2e_s - s.stage_to_ms.get("total", 0) / 1000 for s in ok], 50),
        lag_p99=ms([s.lag_s for s in samples], 99),
    )


def median_stats(runs: list[RunStats]) -> RunStats:
    """Field by field median over repeats, skipping repeats with no successes (nan); errors
    pooled over all requests."""
    error_to_count = sum((r.error_to_count for r in runs), Counter())
    num_requests = sum(r.num_requests for r in runs)
    name_to_ms = {}
    for name in RunStats.__slots__[3:]:  # the times
        values = [value for r in runs if not math.isnan(value := getattr(r, name))]
        name_to_ms[name] = statistics.median(values) if values else float("nan")
    return RunStats(num_requests, 100 * error_to_count.total() / max(1, num_requests), error_to_count, **name_to_ms)


async def one_request(client: httpx.AsyncClient, scheduled: float, timeout_s: float) -> Sample:
    """A request that has no response timeout_s after its scheduled send time is an error."""
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(max(0.0, scheduled + timeout_s - sent)):
            response = await client.post("/v1/completions", json=BODY)
        error = None if response.status_code == 200 else str(response.status_code)
        stage_to_ms = parse_server_timing(response.headers.get("server-timing", ""))
    except (httpx.HTTPError, TimeoutError) as exc:
        error, stage_to_ms = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__, {}
    now = time.perf_counter()
    return Sample(error, now - scheduled, now - sent, sent - scheduled, stage_to_ms)


async def open_loop(client: httpx.AsyncClient, rate: float, duration_s: float, timeout_s: float) -> list[Sample]:
    """Launch rate * duration_s requests at fixed intervals, whatever the responses do."""
    start = time.perf_counter() + 0.01
    tasks = []
    for i in range(round(rate * duration_s)):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_request(client, scheduled, timeout_s)))
    return await asyncio.gather(*tasks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def create_key(db: Path, repo: Path, budget: bool) -> str:
    extra = ["--budget-usd", "1000000"] if budget else []
    result = subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", "create", "--db", str(db), "--name", "bench",
                             "--rpm", "1000000", "--tpm", "1000000000", *extra],
                            cwd=repo, check=True, capture_output=True, text=True, env={**os.environ,
                                                                                       "PYTHONPATH": str(repo)})
    return result.stdout.strip()


def start_server(config: str, workdir: Path, redis_url: str, repo: Path = REPO, label: str | None = None
                 ) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """Spawn one server of `repo`'s code; its URL and the headers its requests need. Does not wait for /ready.
    Its files in workdir are named by `label` (default: the configuration)."""
    label = label or config
    port = free_port()
    # A small KV cache: one-token prompts need little, and six servers side by side must fit in memory.
    args = ["serve", "--port", str(port), "--log-level", "warning", "--no-embeddings", "--kv-cache-memory", "256MiB"]
    headers = {}
    if config == "off":
        args.append("--no-gateway")
    else:
        db = workdir / f"{label}.db"
        budget = config in BUDGET_TO_PLAIN
        headers["Authorization"] = f"Bearer {create_key(db, repo, budget)}"
        args += ["--db", str(db)] + (["--limits-url", redis_url] if config.startswith("redis") else [])
        if budget:
            prices = workdir / f"{label}-prices.toml"
            prices.write_text(PRICES_TOML)
            args += ["--config", str(prices)]
    log = open(workdir / f"{label}.log", "w")  # noqa: SIM115 (the server holds it open)
    process = subprocess.Popen([sys.executable, "-m", "tokenway.cli", *args], cwd=repo, stdout=log, stderr=log,
                               env={**os.environ, "PYTHONPATH": str(repo)})
    return process, f"http://127.0.0.1:{port}", headers


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A private redis-server on loopback. Not scripts/redis.sh's shared one: another process
    (a test run) may stop that one in the middle of this benchmark."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("redis-server not found; scripts/redis.sh start installs it")
    port = free_port()
    process = subprocess.Popen([redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("redis-server did not answer PING")


def wait_ready(process: subprocess.Popen, base_url: str, log: Path) -> None:
    for _ in range(900):
        if process.poll() is not None:
            break
        try:
            if httpx.get(base_url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server {base_url} did not start:\n{log.read_text()[-2000:]}")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_idle(client: httpx.AsyncClient, max_wait_s: float = 60) -> None:
    """Until the server has nothing in flight: requests the client gave up on still run in the
    engine, and the servers share the cores, so the next run must not start on top of them."""
    deadline = time.perf_counter() + max_wait_s
    while time.perf_counter() < deadline:
        stats = (await client.get("/engine/stats", timeout=10)).json()
        if stats["num_running"] + stats["num_waiting"] + stats["num_pending_http"] == 0:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)  # the last reconciles and ledger commits


async def bench(clients: dict[str, httpx.AsyncClient], rates: list[int], duration_s: float, num_repeats: int,
                warmup_s: float, timeout_s: float) -> dict[int, dict[str, RunStats]]:
    for config, client in clients.items():  # connections, code paths, the key cache, the ledger file
        response = await client.post("/v1/completions", json=BODY, headers={"Authorization": ""}, timeout=10)
        refused = response.status_code
        if config != "off" and refused != 401:
            raise SystemExit(f"{config}: a request without a key got {refused}, not 401: is auth on?")
        await open_loop(client, 100, warmup_s, timeout_s)
        await wait_idle(client)
    rate_to_stats: dict[int, dict[str, RunStats]] = {}
    for rate in rates:
        config_to_runs: dict[str, list[RunStats]] = {config: [] for config in clients}
        for _ in range(num_repeats):
            for config, client in clients.items():
                config_to_runs[config].append(summarize(await open_loop(client, rate, duration_s, timeout_s)))
                await wait_idle(client)
        rate_to_stats[rate] = {config: median_stats(runs) for config, runs in config_to_runs.items()}
        print_rate(rate, rate_to_stats[rate])
        if all(s.error_pct >= 1 or s.p99 > BLOWN_P99_S * 1000 for s in rate_to_stats[rate].values()):
            break
    return rate_to_stats


async def run(urls: dict[str, tuple[str, dict[str, str]]], rates: list[int], duration_s: float, num_repeats: int,
              warmup_s: float, timeout_s: float) -> dict[int, dict[str, RunStats]]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    clients = {config: httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=None)
               for config, (url, headers) in urls.items()}
    try:
        return await bench(clients, rates, duration_s, num_repeats, warmup_s, timeout_s)
    finally:
        for client in clients.values():
            await client.aclose()


def print_rate(rate: int, config_to_stats: dict[str, RunStats]) -> None:
    for config, s in config_to_stats.items():
        print(f"{rate:>5} {config:<17} {s.p50:8.2f} {s.p99:8.2f} {s.error_pct:6.2f} | {s.gw_p50:6.3f} {s.gw_p99:6.3f} "
              f"{s.admit_p50:6.3f} {s.admit_p99:6.3f} {s.srv_p50:7.2f} {s.out_p50:6.2f} | {s.lag_p99:6.2f}  "
              + ", ".join(f"{error} x{count}" for error, count in s.error_to_count.most_common()), flush=True)


def gateway_ms(s: RunStats, q: int) -> float:
    """The server's time before the engine: gw + admit at percentile q (a sum of percentiles)."""
    return s.gw_p50 + s.admit_p50 if q == 50 else s.gw_p99 + s.admit_p99


def print_server_errors(workdir: Path, configs: list[str]) -> None:
    """What the servers logged at warning and above (a 500 leaves its traceback there)."""
    for config in configs:
        log = workdir / f"{config}.log"
        lines = log.read_text().splitlines() if log.exists() else []
        line_to_count = Counter(line for line in lines if line and not line.startswith((" ", "tokenway: ")))
        for line, count in line_to_count.most_common(5):
            print(f"server log ({config}) x{count}: {line[:200]}")


def print_summary(rate_to_stats: dict[int, dict[str, RunStats]]) -> None:
    configs = list(next(iter(rate_to_stats.values())))
    print("\nadded vs off, ms (client p50/p99; gw+admit p50/p99 from Server-Timing); * a configuration had >= 1% "
          "errors, so that row measures overload, not the gateway")
    for rate, by_config in rate_to_stats.items():
        off = by_config.get("off")
        overloaded = " *" if any(s.error_pct >= 1 for s in by_config.values()) else ""
        for config, s in by_config.items():
            if config == "off" or off is None:
                continue
            print(f"{rate:>5}  {config:<17} client {s.p50 - off.p50:+7.2f}/{s.p99 - off.p99:+7.2f}  gw+admit "
                  f"{gateway_ms(s, 50) - gateway_ms(off, 50):+7.3f}/{gateway_ms(s, 99) - gateway_ms(off, 99):+7.3f}"
                  f"{overloaded}")
    budgets = [(config + suffix, plain + suffix) for config, plain in BUDGET_TO_PLAIN.items()
               for suffix in ("", BASE) if config + suffix in configs and plain + suffix in configs]
    if budgets:
        print("\nwhat the budget adds, ms: admit (the `limits` stage: budget + limits) p50/p99 and client p50, against "
              "the same configuration without a budget; goal: admit p50 <= +0.1 ms")
        for rate, by_config in rate_to_stats.items():
            for config, plain in budgets:
                s, base = by_config[config], by_config[plain]
                print(f"{rate:>5}  {config:<17} - {plain:<12} admit {s.admit_p50 - base.admit_p50:+7.3f}/"
                      f"{s.admit_p99 - base.admit_p99:+7.3f}  client p50 {s.p50 - base.p50:+7.2f}")
    print(f"\nhighest rate held (< 1% errors at it and every lower rate; tried up to {max(rate_to_stats)} req/s):")
    for config in configs:
        held = None
        for rate, by_config in rate_to_stats.items():
            if by_config[config].error_pct >= 1:
                break
            held = rate
        print(f"    {config:<7} {held or 'none'}")
    if 300 in rate_to_stats and {"off", "memory", "redis"} <= set(configs):
        by_config = rate_to_stats[300]
        off = by_config["off"]
        print("\ntargets at 300 req/s: added p50 <= 1 ms, p99 <= 5 ms; redis p50 <= memory p50 + 1 ms")
        for config in ("memory", "redis"):
            s = by_config[config]
            print(f"    {config:<7} added p50 {s.p50 - off.p50:+.2f} ms, p99 {s.p99 - off.p99:+.2f} ms")
        print(f"    redis - memory p50 {by_config['redis'].p50 - by_config['memory'].p50:+.2f} ms")
        if off.error_pct >= 1:
            print(f"    (inconclusive: with the gateway off, {off.error_pct:.0f}% of requests failed at 300 req/s; "
                  f"this machine cannot carry the rate, so these differences are overload)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)} (default all)")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout of tokenway: also run each configuration chosen but off from its code")
    parser.add_argument("--duration-s", type=float, help="seconds per run (default 10; 3 with --quick)")
    parser.add_argument("--repeats", type=int, help="runs per configuration and rate (default 2)")
    parser.add_argument("--rates", help="comma-separated requests per second (default: rising until overload)")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        raise SystemExit(f"--configs: unknown {', '.join(sorted(unknown))}; known: {', '.join(CONFIGS)}")
    rates = [100, 200, 300, 400, 600] if args.quick else [100, 150, 200, 250, 300, 400, 600]
    if args.rates:
        rates = [int(rate) for rate in args.rates.split(",")]
    duration_s, num_repeats, warmup_s = (3, 2, 2) if args.quick else (10, 2, 4)
    duration_s, num_repeats = args.duration_s or duration_s, args.repeats or num_repeats

    processes: list[subprocess.Popen] = []
    servers: dict[str, tuple[subprocess.Popen, str, dict[str, str]]] = {}
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as workdir:
        try:
            redis, redis_url = start_redis(Path(workdir))
            processes.append(redis)
            for config in configs:
                servers[config] = start_server(config, Path(workdir), redis_url)
                processes.append(servers[config][0])
            for config in configs if args.baseline is not None else ():
                if config != "off":
                    servers[config + BASE] = start_server(config, Path(workdir), redis_url, args.baseline.resolve(),
                                                          label=config + BASE)
                    processes.append(servers[config + BASE][0])
            for config, (process, base_url, _) in servers.items():
                wait_ready(process, base_url, Path(workdir) / f"{config}.log")
            print(f"gateway overhead, open loop, {duration_s} s per run, median of {num_repeats} repeats, "
                  f"configurations interleaved; limits {redis_url} for redis")
            print(f"NOTE: {os.cpu_count()} cores shared by the client, {len(servers)} servers and whatever else runs "
                  f"on this machine: figures are noisy; compare configurations within a rate")
            print(f"{'rate':>5} {'config':<17} {'p50':>8} {'p99':>8} {'err%':>6} | {'gw50':>6} {'gw99':>6} "
                  f"{'adm50':>6} {'adm99':>6} {'srv50':>7} {'out50':>6} | {'lag99':>6}   (ms)")
            urls = {config: (url, headers) for config, (_, url, headers) in servers.items()}
            print_summary(asyncio.run(run(urls, rates, duration_s, num_repeats, warmup_s, TIMEOUT_S)))
        finally:
            for process in reversed(processes):  # servers first (they flush to Redis and the ledger)
                stop_process(process)
        print_server_errors(Path(workdir), list(servers))


if __name__ == "__main__":
    main()
