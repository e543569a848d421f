"""/health latency while large request bodies arrive, and how long each takes to answer.

    python bench/big_bodies_bench.py                        # this checkout
    python bench/big_bodies_bench.py --repo /tmp/old-tree   # ... and another checkout, in the same run

For each checkout: /health probed every 10 ms (one keep-alive connection) for --seconds with
nothing else running, then again while two clients keep sending ~7 MB bodies: a chat request
whose message is 7 MB of text, the same to /tokenize, a completion whose prompt is 7 MB of
token ids, and a 7 MB Anthropic message. Prints /health p50/p99/max for both phases and the
median time to answer each kind of big body (all are refused: each is over the window).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import MODEL, REPO, percentile, start_server  # noqa: E402

TEXT = "hello world " * 600_000  # 7.2 MB


def big_bodies() -> dict[str, tuple[str, bytes]]:
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": TEXT}]}
    return {
        "chat, 7 MB of text": ("/v1/chat/completions", json.dumps(chat).encode()),
        "/tokenize, 7 MB of text": ("/tokenize", json.dumps({"prompt": TEXT}).encode()),
        "completion, 7 MB of token ids": ("/v1/completions", json.dumps(
            {"model": MODEL, "max_tokens": 4, "prompt": [1234] * 1_150_000}).encode()),
        "messages, 7 MB of text": ("/v1/messages", json.dumps(chat).encode()),
    }


def probe_health(base_url: str, seconds: float) -> list[float]:
    latencies = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        client.get("/health")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            client.get("/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    return latencies


def send_big_bodies(base_url: str, stop: threading.Event, timings: dict[str, list[float]], offset: int) -> None:
    bodies = list(big_bodies().items())
    with httpx.Client(base_url=base_url, timeout=120) as client:
        i = offset
        while not stop.is_set():
            name, (path, body) = bodies[i % len(bodies)]
            started = time.perf_counter()
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            timings.setdefault(f"{name} -> {response.status_code}", []).append(time.perf_counter() - started)
            i += 1


def measure(repo: Path, seconds: float, workdir: Path) -> None:
    log = open(workdir / f"{repo.name}.log", "w")  # noqa: SIM115 (the server holds it open)
    process, base_url = start_server("--db", str(workdir / f"{repo.name}.db"), repo=repo, log=log)
    try:
        idle = probe_health(base_url, seconds / 2)
        stop, timings = threading.Event(), {}
        senders = [threading.Thread(target=send_big_bodies, args=(base_url, stop, timings, k)) for k in range(2)]
        for sender in senders:
            sender.start()
        time.sleep(1.0)  # the first bodies are in flight
        loaded = probe_health(base_url, seconds)
        stop.set()
        for sender in senders:
            sender.join()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    print(f"\n{repo}")
    for label, values in (("idle", idle), ("while 7 MB bodies arrive", loaded)):
        print(f"  /health {label:26s} p50 {percentile(values, 50) * 1000:7.1f} ms   p99 "
              f"{percentile(values, 99) * 1000:7.1f} ms   max {max(values) * 1000:7.1f} ms   ({len(values)} probes)")
    for name, values in sorted(timings.items()):
        print(f"  {name:45s} median {percentile(values, 50) * 1000:8.0f} ms over {len(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", default=[], help="another checkout to measure too")
    parser.add_argument("--seconds", type=float, default=30.0, help="probing time under load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for repo in [REPO, *map(Path, args.repo)]:
            measure(repo, args.seconds, Path(workdir))


if __name__ == "__main__":
    main()
