"""`tokenway serve --config` with a registry: a local model with an alias, and a pool of two
tokenway workers that falls back to it. The official openai SDK, unchanged: calls spread over
the workers (the trace names the replica and why), a worker SIGKILLed is routed around (a
call refused before its first byte is retried on the other one), and with both workers gone
the pool falls back to the local model, and the trace says so."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from ..e2e.conftest import Server
from .test_worker import SECRET, SECRET_ENV, Worker

CONFIG = """
[[models]]
name = "small"
aliases = ["gpt-4o-mini"]
  [[models.replicas]]
  kind = "local"

[[models]]
name = "pair"
fallbacks = ["small"]
health = {{interval_s = 0.25, timeout_s = 1.0}}
balancer = {{balance_factor = 1.25}}  # the bound: 1.25 x the mean load + the call: concurrent calls spread
  [[models.replicas]]
  kind = "worker"
  name = "w1"
  url = "{w1}"
  secret_env = "{env}"
  [[models.replicas]]
  kind = "worker"
  name = "w2"
  url = "{w2}"
  secret_env = "{env}"
"""


@pytest.fixture(scope="module")
def topology(default_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gateway")
    secret_file = directory / "secret"
    secret_file.write_text(SECRET + "\n")
    workers = [Worker(secret_file), Worker(secret_file)]
    gateway = None
    try:
        for worker in workers:
            worker.wait_ready()
        config = directory / "gateway.toml"
        config.write_text(CONFIG.format(w1=workers[0].base_url, w2=workers[1].base_url, env=SECRET_ENV))
        gateway = Server("--config", str(config), "--max-model-len", "2048", "--no-embeddings",
                         env={SECRET_ENV: SECRET})
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.kill()


def ask(client, model: str, text: str, max_tokens: int = 24):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0)


def route_of(gateway, request_id: str) -> dict:
    return httpx.get(f"{gateway.base_url}/v1/traces/{request_id}", timeout=10).json()["route"]


def test_the_registry_serves_aliases_pools_and_fallbacks(topology):
    gateway, workers = topology
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert set(models) == {"small", "pair"} and models["small"]["aliases"] == ["gpt-4o-mini"]

    aliased = ask(client, "gpt-4o-mini", "Say hi")
    assert aliased.parse().model == "small"
    assert route_of(gateway, aliased.headers["x-request-id"])["replica"] == "local"

    # Eight calls at once over the pair: the load bound spreads them over both workers.
    with ThreadPoolExecutor(8) as pool:
        raws = list(pool.map(lambda i: ask(client, "pair", f"Tell me fact number {i} about the sea."), range(8)))
    replicas = set()
    for raw in raws:
        completion = raw.parse()
        assert completion.model == "pair" and completion.usage.completion_tokens > 0
        route = route_of(gateway, raw.headers["x-request-id"])
        assert route["pool"] == "pair" and route["reason"] in ("affinity", "least_loaded")
        replicas.add(route["replica"])
    assert replicas == {"w1", "w2"}
    stream = client.chat.completions.create(model="pair", messages=[{"role": "user", "content": "Count to five"}],
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    # One worker killed: every call still succeeds, on the other one.
    workers[0].kill()
    for i in range(6):
        raw = ask(client, "pair", f"Name animal number {i}.")
        assert raw.parse().choices[0].message.content is not None
        assert route_of(gateway, raw.headers["x-request-id"])["replica"] == "w2"
    # ... and it is marked down by the probes, so calls no longer try it first.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "w1" in ready_replicas(gateway):
        time.sleep(0.1)

    # Both gone: the pool falls back to the local model, and the trace says so.
    workers[1].process.send_signal(signal.SIGKILL)
    workers[1].process.wait()
    time.sleep(1.0)  # the probes mark it down (interval 0.25 s)
    raw = ask(client, "pair", "Are you still there?")
    assert raw.parse().choices[0].message.content is not None
    route = route_of(gateway, raw.headers["x-request-id"])
    assert (route["pool"], route["replica"], route["reason"]) == ("small", "local", "fallback")


def ready_replicas(gateway) -> set[str]:
    stats = httpx.get(f"{gateway.base_url}/engine/stats", timeout=5).json()
    return {name for name, view in stats.get("replicas", {}).get("pair", {}).items() if view["available"]}
