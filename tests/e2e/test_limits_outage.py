"""The limits store's Redis stopped under load and started again, on a real server: under
limits_on_error open calls are served, under closed they get 503 limits_unavailable with
Retry-After; never a 500, never a dropped keep-alive connection, and one outage in the log
(not a traceback per call).

The Redis here is a private redis-server (the binary scripts/redis.sh installs), not the
script's shared one: stopping that one would break whatever else is using it meanwhile."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Server, free_port
from .test_gateway_policy import MODEL, create_key, wait_for

BODY = {"model": MODEL, "prompt": [1234], "max_tokens": 1}


class PrivateRedis:
    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            subprocess.run([Path(__file__).resolve().parents[2] / "scripts" / "redis.sh", "start"], check=True,
                           capture_output=True)  # installs it
        self.port, self.workdir = free_port(), workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture()
def redis(tmp_path):
    server = PrivateRedis(tmp_path)
    yield server
    server.stop()


def background_load(base_url: str, key: str, stop: threading.Event, statuses: list[int]) -> threading.Thread:
    """Calls 8 at a time until told to stop, keeping every status."""
    async def load():
        async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            async def one():
                while not stop.is_set():
                    try:
                        statuses.append((await client.post("/v1/completions", json=BODY)).status_code)
                    except httpx.HTTPError as exc:
                        statuses.append(type(exc).__name__)

            await asyncio.gather(*(one() for _ in range(8)))

    thread = threading.Thread(target=asyncio.run, args=(load(),))
    thread.start()
    return thread


def local_port(response: httpx.Response) -> int:
    """The client side's port of the connection a response came on: the same port, the same connection."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_redis_stopped_under_load_and_started_again(default_model_dir, tmp_path, redis, policy):
    db = tmp_path / "outage.db"
    key = create_key(db, "--name", "outage", "--rpm", "100000", "--budget-usd", "1000")
    server = Server("--limits-url", redis.url, "--limits-on-error", policy, "--no-embeddings", db=db)
    try:
        client = httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"},
                              limits=httpx.Limits(max_connections=1))
        first = client.post("/v1/completions", json=BODY)
        assert first.status_code == 200 and first.headers["x-ratelimit-limit-requests"] == "100000"
        port = local_port(first)

        stop, statuses = threading.Event(), []
        load = background_load(server.base_url, key, stop, statuses)
        wait_for(lambda: len(statuses) >= 8, timeout=30)
        redis.stop()
        leased = []  # calls the leases granted before the outage still hold: for at most a second
        if policy == "closed":
            started = time.monotonic()
            wait_for(lambda: leased.append(client.post("/v1/completions", json=BODY)) or
                     leased[-1].status_code == 503, timeout=15)
            assert time.monotonic() - started < 3 and {r.status_code for r in leased[:-1]} <= {200}
        during = [client.post("/v1/completions", json=BODY) for _ in range(10)]
        time.sleep(0.5)  # the load goes on through the outage
        redis.start()
        after = wait_for(lambda: (r := client.post("/v1/completions", json=BODY)).status_code == 200
                         and "x-ratelimit-limit-requests" in r.headers and r, timeout=15)
        stop.set()
        load.join(60)

        assert after, "the store was not used again once Redis answered"
        assert {local_port(r) for r in [*leased, *during, after]} == {port}  # one keep-alive connection throughout
        if policy == "open":
            assert all(r.status_code == 200 for r in during), [r.status_code for r in during]
            assert set(statuses) == {200}, set(statuses)
        else:
            assert all(r.status_code == 503 for r in during), [r.status_code for r in during]
            error = during[0].json()["error"]
            assert error["code"] == "limits_unavailable" and int(during[0].headers["retry-after"]) >= 1
            assert set(statuses) <= {200, 503} and 503 in statuses, set(statuses)
        client.close()
    finally:
        assert server.stop() == 0
    log = server.read_log()
    assert log.count("limits store unavailable") == 1 and log.count("limits store answering again") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
