"""Stages 1 and 7 end to end: keys, limits, budgets and the ledger on a real server."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from .conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret-for-tests"


def create_key(db, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", "create", "--db", str(db), *args],
                         capture_output=True, text=True, cwd=REPO, check=True)
    return out.stdout.strip()


def chat(base_url: str, key: str | None, max_tokens: int = 2, model: str = MODEL, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def ledger_rows(db) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM usage_ledger")]


@pytest.fixture(scope="module")
def gated(default_model_dir):
    server = Server("--admin-key", ADMIN)
    yield server
    assert server.stop() == 0


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


def test_key_lifecycle_401_403_and_no_secret_in_logs(gated):
    # No key yet, on loopback, but an admin key is set: keys are managed here, so auth is on.
    assert chat(gated.base_url, None).json()["error"]["code"] == "no_api_keys"
    key = create_key(gated.db, "--name", "alice", "--models", MODEL)
    other_model_key = create_key(gated.db, "--name", "bob", "--models", "some-other-model")
    # The CLI wrote to the same database: the server sees its keys within its 2 s refresh, and a
    # call without one is then told to send one (before, every call heard that none exists yet).
    assert wait_for(lambda: chat(gated.base_url, None).json()["error"]["code"] == "missing_api_key")
    response = chat(gated.base_url, None)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert chat(gated.base_url, key).status_code == 200
    assert chat(gated.base_url, key + "x").status_code == 401
    assert chat(gated.base_url, other_model_key).status_code == 403
    # x-api-key works too (Anthropic's header).
    anthropic_style = httpx.post(f"{gated.base_url}/v1/messages", headers={"x-api-key": key}, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic_style.status_code == 200

    # Admin API: list (no secrets), rotate, revoke.
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(f"{gated.base_url}/admin/keys", timeout=10).status_code == 401
    listed = httpx.get(f"{gated.base_url}/admin/keys", headers=admin, timeout=10).json()["data"]
    alice = next(k for k in listed if k["name"] == "alice")
    rotated = httpx.post(f"{gated.base_url}/admin/keys/{alice['key_id']}/rotate", headers=admin, timeout=10).json()
    assert wait_for(lambda: chat(gated.base_url, key).status_code == 401)
    assert chat(gated.base_url, rotated["key"]).status_code == 200
    httpx.post(f"{gated.base_url}/admin/keys/{alice['key_id']}/revoke", headers=admin, timeout=10)
    assert wait_for(lambda: chat(gated.base_url, rotated["key"]).status_code == 401)

    log = gated.read_log()
    for secret in (key, other_model_key, rotated["key"]):
        assert secret not in log and secret.split("-", 2)[2] not in log


def test_rpm_exact_and_the_sdk_raises_its_rate_limit_error(gated):
    key = create_key(gated.db, "--name", "rpm", "--rpm", "3")
    assert wait_for(lambda: chat(gated.base_url, None).status_code == 401)  # keys are on (the first turns auth on)
    wait_for(lambda: chat(gated.base_url, key).status_code in (200, 429), timeout=5)  # visible to the server
    client = openai.OpenAI(base_url=f"{gated.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    statuses = []
    for _ in range(3):
        statuses.append(chat(gated.base_url, key).status_code)
    assert statuses.count(200) + 1 >= 3  # the readiness probe above used one of the three
    refused = chat(gated.base_url, key)
    assert refused.status_code == 429
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 60 and int(refused.headers["retry-after-ms"]) <= 60_000
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_the_sdks_own_retry_waits_what_retry_after_says(gated):
    # A key with one slot, held by a stream this test leaves unread: the SDK's call is refused
    # (429, Retry-After 1 s), waits, asks again, and is served once the stream has ended.
    key = create_key(gated.db, "--name", "one-slot", "--max-concurrent", "1")
    assert wait_for(lambda: chat(gated.base_url, None).status_code == 401)  # keys are on (the first turns auth on)
    assert wait_for(lambda: chat(gated.base_url, key).status_code == 200)  # visible to the server
    answers: list[tuple[float, int, str | None]] = []

    def record(response: httpx.Response) -> None:
        answers.append((time.monotonic(), response.status_code, response.headers.get("retry-after")))

    patient = openai.OpenAI(base_url=f"{gated.base_url}/v1", api_key=key, max_retries=5, timeout=120,
                            http_client=httpx.Client(event_hooks={"response": [record]}))
    with httpx.stream("POST", f"{gated.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                            "max_tokens": 4000, "ignore_eos": True, "stream": True}, timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("data: ")  # its first event: the slot is taken
        releases = threading.Timer(2.5, held.close)
        releases.start()
        response = patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
        releases.join()
    assert response.choices[0].message.content is not None
    statuses = [status for _, status, _ in answers]
    assert statuses[0] == 429 and statuses[-1] == 200 and set(statuses) == {429, 200}, answers
    assert all(retry_after == "1" for _, status, retry_after in answers if status == 429)
    # Each retry waited at least what its refusal's Retry-After said (the SDK adds jitter only above it).
    times = [at for at, _, _ in answers]
    assert all(later - earlier >= 0.9 for earlier, later in zip(times, times[1:])), answers


def test_tpm_by_reservation_and_reconciliation(gated):
    # Each request reserves prompt (~30) + max_tokens (200); 500 tokens/minute admit at most 2 at once.
    key = create_key(gated.db, "--name", "tpm", "--tpm", "500")
    wait_for(lambda: chat(gated.base_url, key, max_tokens=1).status_code == 200, timeout=5)

    async def burst():
        async with httpx.AsyncClient(base_url=gated.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(8)))

    responses = asyncio.run(burst())
    admitted = [r for r in responses if r.status_code == 200]
    assert 1 <= len(admitted) <= 2, [r.status_code for r in responses]
    assert all(r.status_code == 429 for r in responses if r.status_code != 200)
    used = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    # Reconciled: what is left is the limit minus what was really used (not what was reserved).
    remaining = int(chat(gated.base_url, key, max_tokens=1).headers["x-ratelimit-remaining-tokens"])
    first_probe_tokens = 40  # the readiness probe and this request: prompt + 1 each, about 40
    assert remaining >= 500 - used - 2 * first_probe_tokens - 30


def test_budget_exhausted_is_429_insufficient_quota(gated, tmp_path):
    # A call reserves its worst case, ~35 tokens at $0.001 here: the first fits, a second could not.
    key = create_key(gated.db, "--name", "budget", "--budget-usd", "0.05")
    # Prices are zero unless configured, so this server never charges: use a priced server.
    config = tmp_path / "prices.toml"
    config.write_text(f'[prices."{MODEL}"]\ninput = 1000.0\noutput = 1000.0\n')
    priced = Server("--config", str(config), db=gated.db)
    try:
        first = chat(priced.base_url, key)
        assert first.status_code == 200
        second = chat(priced.base_url, key)
        assert second.status_code == 429 and second.json()["error"]["code"] == "insufficient_quota"
    finally:
        assert priced.stop() == 0


def test_one_ledger_row_per_call_including_refused_and_disconnected(gated):
    before = {r["request_id"] for r in ledger_rows(gated.db)}
    key = create_key(gated.db, "--name", "ledger")
    wait_for(lambda: chat(gated.base_url, key, max_tokens=1).status_code == 200, timeout=5)
    ok = chat(gated.base_url, key, max_tokens=3)
    bad = chat(gated.base_url, key, max_tokens=-1)
    assert ok.status_code == 200 and bad.status_code == 400

    async def drop_mid_stream():
        async with httpx.AsyncClient(base_url=gated.base_url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 300,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 6:
                        break

    asyncio.run(drop_mid_stream())
    # The dropped stream's row is written right after the disconnect: give it a moment.
    wait_for(lambda: len([r for r in ledger_rows(gated.db) if r["request_id"] not in before]) >= 4, timeout=5)
    new = [r for r in ledger_rows(gated.db) if r["request_id"] not in before]
    by_status = {}
    for row in new:
        by_status.setdefault(row["status"], []).append(row)
    assert ok.json()["id"] in {r["request_id"] for r in new}
    assert len({r["request_id"] for r in new}) == len(new)  # never twice
    assert 400 in by_status and by_status[400][0]["error"]
    dropped = by_status.get(499, [])
    assert len(dropped) == 1 and dropped[0]["completion_tokens"] >= 4 and dropped[0]["error"] == "client disconnected"
    completed = next(r for r in new if r["request_id"] == ok.json()["id"])
    assert completed["completion_tokens"] == ok.json()["usage"]["completion_tokens"]
    assert json.loads(completed["stages_ms"])["decode"] >= 0


def test_kill_9_under_load_loses_no_completed_row(default_model_dir, tmp_path):
    server = Server(db=tmp_path / "crash.db")
    completed: list[str] = []

    async def load():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            async def one(i: int):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}."}],
                        "max_tokens": 4 + i % 5}
                try:
                    response = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    return
                if response.status_code == 200:
                    completed.append(response.json()["id"])

            tasks = [asyncio.create_task(one(i)) for i in range(80)]
            deadline = time.monotonic() + 90
            while len(completed) < 10 and time.monotonic() < deadline:  # kill mid-load
                await asyncio.sleep(0.01)
            server.process.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(load())
    server.process.wait()
    assert completed, "no request completed before the kill"
    restarted = Server(db=tmp_path / "crash.db")
    try:
        ids = [r["request_id"] for r in ledger_rows(tmp_path / "crash.db")]
        assert set(completed) <= set(ids)
        assert len(ids) == len(set(ids))
    finally:
        restarted.stop()


def test_two_gateways_sharing_redis_never_over_admit(default_model_dir, tmp_path, redis_url):
    db = tmp_path / "shared.db"
    key = create_key(db, "--name", "shared", "--rpm", "50")
    servers = [Server("--limits-url", redis_url, db=db), Server("--limits-url", redis_url, db=db)]
    try:
        async def storm():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=220),
                                         headers={"Authorization": f"Bearer {key}"}) as client:
                body = {"model": MODEL, "prompt": [1234], "max_tokens": 1}
                return await asyncio.gather(*(
                    client.post(f"{servers[i % 2].base_url}/v1/completions", json=body) for i in range(200)))

        responses = asyncio.run(storm())
        statuses = [r.status_code for r in responses]
        assert statuses.count(200) == 50, statuses  # exactly the limit, across both processes
        assert statuses.count(429) == 150
        assert all(int(r.headers["retry-after"]) >= 1 for r in responses if r.status_code == 429)
        # Both processes decided (which one admits more is a race, and either may take all 50).
        for i in (0, 1):
            assert {r.status_code for r in responses[i::2]} <= {200, 429} and len(responses[i::2]) == 100
    finally:
        for server in servers:
            assert server.stop() == 0


def test_rate_limit_headers_on_every_v1_response(gated):
    key = create_key(gated.db, "--name", "headers", "--rpm", "100", "--tpm", "100000")
    wait_for(lambda: chat(gated.base_url, key, max_tokens=1).status_code == 200, timeout=5)
    auth = {"Authorization": f"Bearer {key}"}
    for response in (chat(gated.base_url, key, max_tokens=1),
                     chat(gated.base_url, key, max_tokens=-1),  # refused before admission
                     httpx.get(f"{gated.base_url}/v1/models", headers=auth, timeout=10)):
        assert response.headers["x-ratelimit-limit-requests"] == "100", response.status_code
        assert response.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(response.headers["x-ratelimit-remaining-requests"]) <= 100
