"""Creating a large batch on a real `tokenway serve`: /health latency meanwhile, the create's time,
the server's memory, and the data directory before, after and once the batch is deleted.

    python bench/batch_create_bench.py                        # this checkout
    python bench/batch_create_bench.py --repo /tmp/old-tree   # ... and another checkout, in the same run
    python bench/batch_create_bench.py --requests 20000       # a smaller one

For each checkout, on a fresh data directory: /health probed every 5 ms (one keep-alive
connection) while an Anthropic Message Batch of --requests requests (~137 bytes of params each:
13.7 MB for 100,000) is created, then while a 50,000-line OpenAI batch file is uploaded and a
batch made of it, then while a 100,000-line file is uploaded (refused: OpenAI's cap is 50,000).
Both batches are cancelled at once (their lines would take the CPU); the data directory is
measured again once the message batch is deleted, and once the uploaded file is, each after the
store's next upkeep has given the space back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import MODEL, REPO, percentile  # noqa: E402

START_TIMEOUT_S = 900.0  # a loaded 2-core machine can take minutes to load the model


def start_server(*extra: str, repo: Path, log) -> tuple[subprocess.Popen, str]:
    """`tokenway serve` from the checkout `repo` on a free loopback port, once it is ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "tokenway.cli", "serve", "--port", str(port),
                                "--log-level", "warning", *extra], cwd=repo,
                               env={**os.environ, "PYTHONPATH": str(repo)}, stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(base_url + "/ready", timeout=2).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server from {repo} did not start")


def params(i: int) -> dict:
    return {"model": MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": f"Question {i:06d}: what is the capital of France, briefly?"}]}


def message_batch(num_requests: int) -> bytes:
    return json.dumps({"requests": [{"custom_id": f"q{i}", "params": params(i)}
                                    for i in range(num_requests)]}).encode()


def batch_file(num_lines: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": params(i)}).encode() + b"\n" for i in range(num_lines))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def dir_mb(path: Path) -> float:
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file()) / 2**20


def while_probing(base_url: str, work: Callable[[httpx.Client], httpx.Response]) -> tuple[httpx.Response, float,
                                                                                           list[float]]:
    """work's response and seconds, and /health's latencies while it ran."""
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            client.get("/health")
            while not done.is_set():
                started = time.perf_counter()
                client.get("/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.3)
    with httpx.Client(base_url=base_url, timeout=300) as client:
        started = time.perf_counter()
        response = work(client)
        elapsed = time.perf_counter() - started
    time.sleep(0.2)
    done.set()
    prober.join()
    return response, elapsed, latencies


def end_and_delete(client: httpx.Client, path: str, batch_id: str, ended: Callable[[dict], bool]) -> None:
    client.post(f"{path}/{batch_id}/cancel")
    while not ended(client.get(f"{path}/{batch_id}").json()):
        time.sleep(0.5)


def report(label: str, response: httpx.Response, elapsed: float, latencies: list[float]) -> None:
    print(f"  {label:44s} {response.status_code} in {elapsed:6.2f} s   /health p50 "
          f"{percentile(latencies, 50) * 1000:6.1f} ms  p99 {percentile(latencies, 99) * 1000:6.1f} ms  max "
          f"{max(latencies) * 1000:7.1f} ms  ({len(latencies)} probes)")


def measure(repo: Path, num_requests: int, workdir: Path) -> None:
    data = workdir / repo.name
    data.mkdir()
    log = open(workdir / f"{repo.name}.log", "w")  # noqa: SIM115 (the server holds it open)
    process, base_url = start_server("--db", str(data / "ledger.db"), repo=repo, log=log)
    print(f"\n{repo}")
    try:
        client = httpx.Client(base_url=base_url, timeout=300)
        before_mb, rss_before = dir_mb(data), rss_mb(process.pid)
        body = message_batch(num_requests)
        created, elapsed, latencies = while_probing(base_url, lambda c: c.post(
            "/v1/messages/batches", content=body, headers={"content-type": "application/json"}))
        report(f"message batch, {num_requests:,} requests ({len(body) / 1e6:.1f} MB)", created, elapsed, latencies)
        print(f"  server RSS {rss_before:.0f} -> {rss_mb(process.pid):.0f} MB;  data directory {before_mb:.1f} -> "
              f"{dir_mb(data):.1f} MB")
        message_batch_id = created.json()["id"]
        end_and_delete(client, "/v1/messages/batches", message_batch_id,
                       lambda batch: batch["processing_status"] == "ended")
        client.delete(f"/v1/messages/batches/{message_batch_id}")
        time.sleep(12)  # the runner's upkeep (every 5 s) gives the freed pages back
        print(f"  data directory once the message batch is deleted: {dir_mb(data):.1f} MB")

        content = batch_file(50_000)
        uploaded, elapsed, latencies = while_probing(base_url, lambda c: c.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("requests.jsonl", content)}))
        report(f"upload, 50,000 lines ({len(content) / 1e6:.1f} MB)", uploaded, elapsed, latencies)
        file_id = uploaded.json()["id"]
        batch, elapsed, latencies = while_probing(base_url, lambda c: c.post("/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        report("POST /v1/batches of it", batch, elapsed, latencies)
        end_and_delete(client, "/v1/batches", batch.json()["id"],
                       lambda batch: batch["status"] in ("cancelled", "completed", "failed", "expired"))
        too_many = batch_file(100_000)
        refused, elapsed, latencies = while_probing(base_url, lambda c: c.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("requests.jsonl", too_many)}))
        report(f"upload, 100,000 lines ({len(too_many) / 1e6:.1f} MB)", refused, elapsed, latencies)
        print(f"  server RSS after all three {rss_mb(process.pid):.0f} MB;  data directory {dir_mb(data):.1f} MB")

        client.delete(f"/v1/files/{file_id}")  # an OpenAI batch is never deleted (no such route): its lines stay
        time.sleep(12)
        print(f"  data directory once the 50,000-line file is deleted: {dir_mb(data):.1f} MB "
              f"(it was {before_mb:.1f} MB at the start)")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # figures as they come
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", default=[], help="another checkout to measure too")
    parser.add_argument("--requests", type=int, default=100_000, help="the message batch's requests")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for repo in [REPO, *map(Path, args.repo)]:
            measure(repo, args.requests, Path(workdir))


if __name__ == "__main__":
    main()
