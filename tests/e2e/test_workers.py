"""`tokenway serve --workers 4` as a gateway in front of an upstream on loopback: limits exact
across the workers without a Redis, one /metrics for the host, and a SIGHUP reload that drops
no call."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from .conftest import REPO, Server

MODEL = "stub-model"
NUM_WORKERS = 4


class _Upstream(BaseHTTPRequestHandler):
    """An OpenAI-compatible upstream that answers every chat at once, streamed or not."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if body.get("stream"):
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                      {"choices": [], "usage": usage}]
            payload = b"".join(b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                                        "model": body["model"], **c}).encode() + b"\n\n"
                               for c in chunks) + b"data: [DONE]\n\n"
            content_type = "text/event-stream"
        else:
            payload = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                                               "finish_reason": "stop"}], "usage": usage}).encode()
            content_type = "application/json"
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 - the health probe's GET /v1/models
        payload = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


class _WideBacklog(ThreadingHTTPServer):
    # socketserver's default backlog of 5 drops connections from a 50-call burst on a busy
    # machine, and the gateway then answers them 502: a failure of this stub, not of the limits.
    request_queue_size = 256


@pytest.fixture(scope="module")
def upstream():
    server = _WideBacklog(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()


def start_gateway(folder, upstream_port: int, num_workers: int, *extra: str, config_extra: str = "",
                  **key_limits: list[str]):
    """A gateway-only `tokenway serve --workers N` and its keys (name -> limit flags)."""
    config = folder / "gateway.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\ncontext_window = 8192\n  [[models.replicas]]\n'
                      f'  kind = "openai"\n  url = "http://127.0.0.1:{upstream_port}/v1"\n'
                      f'  model = "{MODEL}"\n' + config_extra)
    db = folder / "keys.db"

    def create_key(limits: list[str]) -> str:
        return subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", "--db", str(db), "create", "--name",
                               "t", *limits], check=True, capture_output=True, text=True, cwd=REPO).stdout.strip()

    keys = {name: create_key(limits) for name, limits in key_limits.items()}
    server = Server("--config", str(config), "--workers", str(num_workers), "--no-embeddings", *extra, db=db)
    deadline = time.monotonic() + 120
    while "workers serving" not in server.read_log():  # /ready answers once the first of them does
        assert time.monotonic() < deadline, server.read_log()[-3000:]
        time.sleep(0.1)
    return server, keys


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstream):
    server, keys = start_gateway(tmp_path_factory.mktemp("workers"), upstream, NUM_WORKERS,
                                 limited=["--rpm", "50"], open=[])
    yield server, keys
    assert server.stop() == 0, server.read_log()[-3000:]


def chat(client: httpx.AsyncClient, key: str):
    return client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def samples(text: str, name: str) -> list[tuple[str, float]]:
    return [(m.group(1), float(m.group(2))) for m in re.finditer(rf"^{name}(\{{.*?\}})? (\S+)$", text, re.M)]


def test_rpm_is_exact_across_workers_and_metrics_are_the_hosts(gateway):
    server, keys = gateway

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(chat(client, keys["limited"]) for _ in range(200)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    others = [r.text[:300] for r in responses if r.status_code not in (200, 429)]
    assert statuses.count(200) == 50 and statuses.count(429) == 150, (collections.Counter(statuses), others)
    assert all(int(r.headers["retry-after"]) >= 1 for r in responses if r.status_code == 429)

    # Any worker answers for all of them: every call counted, and each worker's gauges there.
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    served = sum(value for labels, value in samples(text, "tokenway_requests_total") if 'status="200"' in labels)
    assert served == 50
    limited = sum(value for _, value in samples(text, "tokenway_rate_limited_total"))
    assert limited == 150
    workers = {re.search(r'worker="(\d+)"', labels).group(1)  # type: ignore[union-attr]
               for labels, _ in samples(text, "process_start_time_seconds")}
    assert workers == {str(i) for i in range(NUM_WORKERS)}


def test_workers_share_a_redis_when_given_one(tmp_path, upstream, redis_url):
    server, keys = start_gateway(tmp_path, upstream, 2, "--limits-url", redis_url, limited=["--rpm", "30"])
    try:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                return [r.status_code for r in await asyncio.gather(*(chat(client, keys["limited"])
                                                                     for _ in range(90)))]

        import redis

        store = redis.Redis.from_url(redis_url)
        windows_before = set(store.scan_iter("*:win"))
        statuses = asyncio.run(burst())
        assert statuses.count(200) == 30 and statuses.count(429) == 60, statuses
        assert set(store.scan_iter("*:win")) - windows_before  # counted there, not by the supervisor
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]


def test_a_budget_spent_through_the_workers_is_exact(tmp_path, upstream):
    # $1,000 per million tokens: each call (5 prompt + 2 completion tokens, the upstream says)
    # costs $0.007; a budget of $1 holds 142 of them, and a part of it (1/16) several at once:
    # the workers reserve from leases of it.
    server, keys = start_gateway(tmp_path, upstream, 2, config_extra=f'[prices."{MODEL}"]\ninput = 1000.0\n'
                                 'output = 1000.0\n', budgeted=["--budget-usd", "1"])
    try:
        async def bursts() -> list[int]:
            statuses = []
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                         limits=httpx.Limits(max_connections=100)) as client:
                for _ in range(4):
                    statuses += [r.status_code for r in await asyncio.gather(*(chat(client, keys["budgeted"])
                                                                               for _ in range(50)))]
            return statuses

        statuses = asyncio.run(bursts())
        assert set(statuses) == {200, 429}, statuses
        # Never over the budget, and no more than the last few calls' worth short of it.
        assert 125 <= statuses.count(200) <= 142, statuses.count(200)
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]


def test_sighup_reloads_without_dropping_a_call(gateway):
    server, keys = gateway
    stop = threading.Event()
    statuses: list[int | str] = []

    async def load() -> None:
        # A connection per call: a kept-alive one closed while idle by a draining worker is a
        # client's retry to make (as with any server that stops); the listener's handover is ours.
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            async def one() -> None:
                while not stop.is_set():
                    try:
                        statuses.append((await chat(client, keys["open"])).status_code)
                    except httpx.HTTPError as exc:
                        statuses.append(repr(exc))

            await asyncio.gather(*(one() for _ in range(16)))

    loader = threading.Thread(target=lambda: asyncio.run(load()))
    loader.start()
    try:
        while len(statuses) < 50:
            time.sleep(0.05)
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 120
        while server.read_log().count("tokenway: stopped") < NUM_WORKERS:
            assert time.monotonic() < deadline, server.read_log()[-3000:]
            time.sleep(0.1)
        num_before = len(statuses)
        while len(statuses) < num_before + 50:  # and the new generation serves
            time.sleep(0.05)
    finally:
        stop.set()
        loader.join()
    assert "reloaded" in server.read_log()
    assert set(statuses) == {200}, [s for s in statuses if s != 200][:5]


def test_workers_refuse_a_bad_count(capsys):
    from tokenway.cli import main

    assert main(["serve", "--workers", "0", "--port", "1"]) == 2
    assert "workers: must be >= 1" in capsys.readouterr().err


def test_a_local_model_is_one_engine_behind_every_worker(default_model_dir):
    """The default model with --workers 2: one `tokenway worker` holds the engine, both HTTP
    workers route to it, and greedy output is what the model says."""
    server = Server("--workers", "2", "--no-embeddings")
    try:
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 8, "temperature": 0}
        texts = {httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
                 .json()["choices"][0]["message"]["content"] for _ in range(6)}
        assert len(texts) == 1 and texts != {""}
        log = server.read_log()
        assert log.count("tokenway: worker serving") == 1 and log.count("ready") >= 2, log[-3000:]
        # The engine's worker killed: started again, and the HTTP workers route to it once it answers.
        engine_pid = int(subprocess.run(["pgrep", "-P", str(server.process.pid), "-f", "tokenway.cli worker"],
                                        capture_output=True, text=True, check=True).stdout.split()[0])
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).status_code != 200:
            assert time.monotonic() < deadline, server.read_log()[-3000:]
            time.sleep(0.5)
        assert "starting it again" in server.read_log()
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]


def test_a_worker_that_dies_is_replaced(gateway):
    server, keys = gateway

    def worker_pids() -> set[int]:
        found = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True)
        return {int(pid) for pid in found.stdout.split()}

    before, num_ready = worker_pids(), server.read_log().count(" ready")
    assert len(before) == NUM_WORKERS
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (len(worker_pids()) == NUM_WORKERS and victim not in worker_pids()
               and server.read_log().count(" ready") > num_ready):
        assert time.monotonic() < deadline, server.read_log()[-3000:]
        time.sleep(0.2)
    assert "exited with -9; starting another" in server.read_log()
    headers = {"authorization": f"Bearer {keys['open']}"}
    responses = [httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=30,
                            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) for _ in range(8)]
    assert {r.status_code for r in responses} == {200}
