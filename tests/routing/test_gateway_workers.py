"""Three tokenway workers behind a gateway that runs no model itself. A shared-prefix workload
gets a far higher prompt-cache hit rate on the workers with prefix affinity than round robin.
Then 200 concurrent calls
(half of them streams), and one worker SIGKILLed mid-run: every call that had not started on
it succeeds, the streams that were running on it end with an error event (none hang), it is
marked down within 2 s by the default health checks, and taken back within 2 s of its
restart. Nothing leaks: every replica's in-flight count is back to 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from ..e2e.conftest import Server
from .test_worker import SECRET, SECRET_ENV, Worker

CONFIG = """
[[models]]
name = "trio"
max_in_flight = 128
{replicas}
[[models]]
name = "trio-rr"  # the same workers, taken in turn: the baseline prefix affinity is measured against
balancer = {{policy = "round_robin"}}
{replicas}
"""
REPLICA = """  [[models.replicas]]
  kind = "worker"
  name = "{name}"
  url = "{url}"
  secret_env = "{env}"
"""
NUM_CALLS = 200


@pytest.fixture(scope="module")
def trio(default_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("trio")
    secret_file = directory / "secret"
    secret_file.write_text(SECRET + "\n")
    workers = {name: Worker(secret_file) for name in ("w1", "w2", "w3")}
    gateway = None
    try:
        for worker in workers.values():
            worker.wait_ready()
        config = directory / "gateway.toml"
        config.write_text(CONFIG.format(replicas="".join(
            REPLICA.format(name=name, url=worker.base_url, env=SECRET_ENV) for name, worker in workers.items())))
        gateway = Server("--config", str(config), "--no-embeddings", env={SECRET_ENV: SECRET})
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers.values():
            worker.kill()


def replica_views(gateway, model: str = "trio") -> dict[str, dict]:
    return httpx.get(f"{gateway.base_url}/engine/stats", timeout=5).json()["replicas"][model]


async def call(client: httpx.AsyncClient, i: int, started: list[int]) -> dict:
    """One call's outcome: its request id, whether it succeeded, and for a stream whether it
    ended with an error event (then [DONE]) rather than being cut or hanging."""
    stream = i % 2 == 0
    body = {"model": "trio", "max_tokens": 24, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"Write a sentence about the number {i}."}]}
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        return {"id": response.headers.get("x-request-id"), "ok": response.status_code == 200,
                "status": response.status_code, "stream": False}
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:  # the role chunk, then the first text: it is decoding
                    started[0] += 1
    error = len(events) >= 2 and events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    ok = response.status_code == 200 and events[-1:] == ["[DONE]"] and not error
    return {"id": response.headers.get("x-request-id"), "ok": ok, "status": response.status_code, "stream": True,
            "error_event": error, "num_events": len(events)}


def shared_prefix_hit_rate(gateway, model: str, topic: str) -> tuple[float, list[str]]:
    """Four long system prompts, three questions each, interleaved (p0 q0, p1 q0, ... p0 q1, ...):
    the pool's prompt-cache hit rate as its replicas reported it, and each call's routing reason."""
    client = httpx.Client(base_url=gateway.base_url, timeout=120)
    before = {name: (view["prompt_tokens"], view["cached_tokens"])
              for name, view in replica_views(gateway, model).items()}
    reasons = []
    for question in range(3):
        for prefix in range(4):
            system = f"You are assistant {prefix} for {topic}. " + " ".join(
                f"Rule {i}: answer questions about {topic} number {prefix} precisely." for i in range(25))
            response = client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Question {question}?"}]})
            assert response.status_code == 200, response.text
            trace = client.get(f"/v1/traces/{response.headers['x-request-id']}").json()
            reasons.append(trace["route"]["reason"])
    views = replica_views(gateway, model)
    prompt = sum(view["prompt_tokens"] - before[name][0] for name, view in views.items())
    cached = sum(view["cached_tokens"] - before[name][1] for name, view in views.items())
    return cached / prompt, reasons


def test_prefix_affinity_hits_the_prompt_cache_where_round_robin_misses(trio):
    gateway, _ = trio
    round_robin, rr_reasons = shared_prefix_hit_rate(gateway, "trio-rr", "tides")
    affinity, reasons = shared_prefix_hit_rate(gateway, "trio", "volcanoes")  # other prompts: cold caches
    print(f"\nprompt-cache hit rate on the workers, 4 shared prefixes x 3 calls over 3 replicas: "
          f"affinity {affinity:.1%}, round robin {round_robin:.1%}")
    assert set(rr_reasons) == {"round_robin"}
    assert reasons.count("affinity") == 8  # every call after a prefix's first
    assert affinity > round_robin + 0.4


def test_a_worker_killed_under_load_is_routed_around_marked_down_and_taken_back(trio):
    gateway, workers = trio
    victim = workers["w1"]

    async def run() -> tuple[list[dict], float, float]:
        limits = httpx.Limits(max_connections=NUM_CALLS + 10, max_keepalive_connections=NUM_CALLS + 10)
        async with httpx.AsyncClient(base_url=gateway.base_url, limits=limits, timeout=240) as client:
            started = [0]  # streams that have received text
            calls = [asyncio.create_task(call(client, i, started)) for i in range(NUM_CALLS)]
            # Mid-run: once streams are decoding and the victim runs calls of its own.
            deadline = time.monotonic() + 120
            while (started[0] < 15 or replica_views(gateway)["w1"]["num_in_flight"] < 5) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not all(task.done() for task in calls)
            victim.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            while replica_views(gateway)["w1"]["available"]:
                await asyncio.sleep(0.05)
            marked_down_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*calls), timeout=300)  # none hangs
        return results, killed_at, marked_down_at

    results, killed_at, marked_down_at = asyncio.run(run())
    assert marked_down_at - killed_at < 2.0

    failed_on_victim = 0
    for result in results:
        trace = httpx.get(f"{gateway.base_url}/v1/traces/{result['id']}", timeout=10).json()
        replica = trace["route"]["replica"]
        if result["ok"]:
            continue
        # Only a call already running on the killed worker may fail, and a stream says so in an error event.
        assert replica == "w1", (result, trace["route"])
        assert result["error_event"] if result["stream"] else result["status"] >= 500, result
        failed_on_victim += 1
    assert failed_on_victim >= 1  # some of its calls were decoding: they end in error, never retried
    assert sum(r["ok"] for r in results) >= NUM_CALLS - 128

    # Restarted on its port: taken back within 2 s of being ready.
    workers["w1"] = Worker(victim.secret_file, port=victim.port).wait_ready()
    ready_at = time.monotonic()
    while not replica_views(gateway)["w1"]["available"]:
        assert time.monotonic() - ready_at < 2.0, replica_views(gateway)["w1"]
        time.sleep(0.05)
    taken_back_s = time.monotonic() - ready_at
    views = replica_views(gateway)
    print(f"\n{sum(r['ok'] for r in results)}/{NUM_CALLS} ok, {failed_on_victim} failed on the killed worker; "
          f"marked down {marked_down_at - killed_at:.2f} s after the kill, taken back {taken_back_s:.2f} s after "
          f"its restart; calls per replica {({name: view['num_calls'] for name, view in views.items()})}")
    assert all(view["num_in_flight"] == 0 and view["num_outstanding_tokens"] == 0 for view in views.values()), views
    assert views["w1"]["num_failures"] >= failed_on_victim
