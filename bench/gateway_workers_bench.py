"""Gateway throughput with `tokenway serve --workers N`: closed loop, gateway-only, instant upstream.

    python bench/gateway_workers_bench.py                       # --workers 1 and 2, 10 s each
    python bench/gateway_workers_bench.py --workers 1,2,4 --seconds 5 --pin

One model routed to ../shared/bench/upstream_stub.py (an instant OpenAI-compatible stub), one
API key with limits far above the load, the SQLite ledger and traces on: every call is
authenticated, admitted by the supervisor's counters, routed, billed and traced. Client
processes (--clients, each --concurrency connections over raw keep-alive HTTP/1.1) send
non-streamed chat completions as fast as answers come back, for --seconds after a warm-up.
Prints requests/s, p50/p99 latency and the scaling against --workers 1, and the gateway's CPU
time per call by process (the supervisor, which owns the counters, apart from the workers): on
a host with cores to spare, N workers serve N / (CPU a call takes in all) calls a second, so the
scaling a larger host would see is (CPU a call takes in one process) / (what it takes in all)
times N, up to the supervisor's own ceiling of 1 / (its CPU a call).

--limits-url redis://... puts the limits in that Redis (scripts/redis.sh start): the gateways'
CPU a call then leaves out Redis's own.

--pin runs each role on its own CPUs with taskset: the gateway (supervisor and workers) on the
first N cores, the stub and the clients on the rest. That is how to see the 0.8·N scaling on a
host with cores to spare: with N gateway cores and enough left for the clients and the stub,
the gateway is the only bottleneck. On a 2-core machine the clients and the stub take much of
the CPU the workers would use, so the figure there bounds the scaling from below, no more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
STUB = REPO.parent / "shared" / "bench" / "upstream_stub.py"
MODEL = "bench-model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not ready")


async def client_loop(port: int, key: str, concurrency: int, warmup_s: float,
                      seconds: float) -> tuple[list[float], int]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, until = start + warmup_s, start + warmup_s + seconds
    latencies: list[float] = []
    num_calls = 0  # the warm-up's too

    async def connection() -> None:
        nonlocal num_calls
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while (now := loop.time()) < until:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode(errors="replace"))
            num_calls += 1
            if now >= measure_from:
                latencies.append(loop.time() - now)
        writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return latencies, num_calls


def run_client(args: tuple) -> tuple[list[float], int]:
    return asyncio.run(client_loop(*args))


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of one process so far (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def gateway_cpu(server_pid: int, num_workers: int) -> tuple[float, float]:
    """(the supervisor's CPU seconds, the workers'); with one worker, the one process is the worker."""
    if num_workers == 1:
        return 0.0, cpu_seconds(server_pid)
    return cpu_seconds(server_pid), sum(cpu_seconds(pid) for pid in children(server_pid))


def taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def measure(num_workers: int, args: argparse.Namespace, stub_port: int, folder: Path) -> dict:
    num_cpus = os.cpu_count() or 1
    gateway_cpus = f"0-{num_workers - 1}" if args.pin else None
    config = folder / f"gateway-{num_workers}.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\ncontext_window = 8192\n  [[models.replicas]]\n'
                      f'  kind = "openai"\n  url = "http://127.0.0.1:{stub_port}/v1"\n  model = "{MODEL}"\n')
    db = folder / f"keys-{num_workers}.db"
    key = subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", "--db", str(db), "create", "--name", "b",
                          "--rpm", "100000000", "--tpm", "100000000000",
                          *(["--budget-usd", args.budget_usd] if args.budget_usd else [])],
                         check=True, capture_output=True, text=True, cwd=REPO).stdout.strip()
    port = free_port()
    server = subprocess.Popen([*taskset(gateway_cpus), sys.executable, "-m", "tokenway.cli", "serve", "--config",
                               str(config), "--db", str(db), "--port", str(port), "--workers", str(num_workers),
                               "--no-embeddings", "--log-level", "warning",
                               *(["--limits-url", args.limits_url] if args.limits_url else [])],
                              cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", server)
        if args.pin and num_workers < num_cpus:
            os.sched_setaffinity(0, set(range(num_workers, num_cpus)))  # the clients, spawned from here
        with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
            cpu_before = gateway_cpu(server.pid, num_workers)
            per_client = pool.map(run_client, [(port, key, args.concurrency, args.warmup, args.seconds)]
                                  * args.clients)
            cpu_after = gateway_cpu(server.pid, num_workers)
    finally:
        os.sched_setaffinity(0, set(range(num_cpus)))
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    latencies = sorted(x for client, _ in per_client for x in client)
    num_calls = sum(n for _, n in per_client)
    supervisor_s, workers_s = (after - before for after, before in zip(cpu_after, cpu_before))
    return {"workers": num_workers, "rps": len(latencies) / args.seconds,
            "p50_ms": statistics.median(latencies) * 1000, "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
            "supervisor_us": supervisor_s / num_calls * 1e6, "workers_us": workers_s / num_calls * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=32, help="connections per client process")
    parser.add_argument("--pin", action="store_true", help="gateway on the first N cores, the rest elsewhere")
    parser.add_argument("--limits-url", help="the gateway's --limits-url (redis://...: scripts/redis.sh start)")
    parser.add_argument("--budget-usd", help="the key has this budget")
    args = parser.parse_args()
    if not STUB.exists():
        raise SystemExit(f"the upstream stub is not at {STUB}")
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, str(STUB), "--port", str(stub_port)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{stub_port}/health", stub)
        with tempfile.TemporaryDirectory(prefix="tw-workers-bench-") as folder:
            for num_workers in (int(n) for n in args.workers.split(",")):
                rows.append(measure(num_workers, args, stub_port, Path(folder)))
                row = rows[-1]
                cpu_us = row["supervisor_us"] + row["workers_us"]
                print(f"workers {row['workers']}: {row['rps']:.0f} req/s, p50 {row['p50_ms']:.2f} ms, "
                      f"p99 {row['p99_ms']:.2f} ms, scaling x{row['rps'] / rows[0]['rps']:.2f}; CPU a call "
                      f"{cpu_us:.0f} us (workers {row['workers_us']:.0f}, supervisor {row['supervisor_us']:.0f})"
                      + (f": on free cores x{rows[0]['workers_us'] / cpu_us:.2f} a worker"
                         if rows[0]["workers"] == 1 and row["workers"] > 1 else ""), flush=True)
    finally:
        stub.terminate()
        stub.wait()
    print(f"({os.cpu_count()} CPUs, {args.clients} client processes x {args.concurrency} connections, "
          f"{args.seconds:.0f} s each{', pinned' if args.pin else ''})")


if __name__ == "__main__":
    main()
