"""Two gateways on one store: `tokenway serve --store-url postgresql://...` twice, on one
PostgreSQL (keys and ledger) and one Redis (limits and budgets), gateway-only in front of a
scripted upstream on loopback. A key made through one's admin API works on the other; revoked
through the other, both refuse it; a budget spent through both at once ends exactly where it
should, neither gateway admitting past it. (How fast a change travels is the change feed's
business and is tested on its own in tests/gateway/test_keystore_postgres.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from ..routing.stub_upstream import DONE, Reply, StubUpstream, openai_chunk, openai_usage
from .conftest import Server

ADMIN_KEY = "admin-shared-store-0123456789"
MAX_TOKENS = 4
# A completion token costs $0.001 and a prompt token nothing, so each call's cost is its worst
# case, 4 tokens: $0.004, whatever the gateway reckons its prompt to be.
CONFIG = """
[[models]]
name = "remote"
context_window = 4096
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "openai"
  name = "stub"
  url = "{url}"
  model = "up"

[prices.remote]
input = 0.0
cached_input = 0.0
output = 1000.0
"""
BUDGET_USD = 0.05
CALL_NANOS = MAX_TOKENS * 1_000_000
NUM_CALLS = 30


@pytest.fixture(scope="module")
def upstream() -> Iterator[StubUpstream]:
    with StubUpstream(answer_models=True) as stub:
        stub.script(Reply(chunks=(openai_chunk(text="ok"), openai_chunk(finish_reason="length"),
                                  openai_usage(3, MAX_TOKENS), DONE)))
        yield stub


@pytest.fixture
def gateways(upstream, postgres_database, redis_url, tmp_path) -> Iterator[tuple[Server, Server]]:
    config = tmp_path / "gateway.toml"
    config.write_text(CONFIG.format(url=upstream.base_url))
    args = ("--config", str(config), "--no-embeddings", "--store-url", postgres_database, "--ledger-url",
            postgres_database, "--limits-url", redis_url, "--admin-key", ADMIN_KEY)
    servers: list[Server] = []
    try:
        for _ in range(2):
            servers.append(Server(*args))
        # An admin key keeps auth on from the start, and a key once made keeps it on for every
        # gateway on the store: an unknown or revoked key is refused, never let in anonymously.
        admin(servers[0], "POST", "/keys", json={"name": "auth-on"})
        until(lambda: all(auth_on(server) for server in servers), "auth on, on both gateways")
        yield servers[0], servers[1]
    finally:
        for server in servers:
            assert server.stop() == 0, server.read_log()[-3000:]


def admin(server: Server, method: str, path: str, **kwargs: Any) -> dict:
    response = httpx.request(method, f"{server.base_url}/admin{path}", timeout=10,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kwargs)
    assert response.status_code in (200, 201), response.text
    return response.json()


def status_of(server: Server, key: str) -> int:
    """One streamed call's status: the upstream streams either way."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30)
    try:
        stream = client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=MAX_TOKENS, stream=True)
    except openai.APIStatusError as exc:
        return exc.status_code
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == "ok"
    return 200


def auth_on(server: Server) -> bool:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401


def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> float:
    """Seconds until condition() held; the timeout only keeps a broken gateway from hanging the test."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"never saw {what}"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_key_made_on_one_gateway_works_on_the_other_and_a_revocation_reaches_both(gateways):
    made_on, other = gateways
    created = admin(made_on, "POST", "/keys", json={"name": "shared", "rpm": 1000})
    key = created["key"]
    assert status_of(made_on, key) == 200
    seen_s = until(lambda: status_of(other, key) == 200, "the new key on the other gateway")
    assert created["key_id"] in [info["key_id"] for info in admin(other, "GET", "/keys")["data"]]

    revoked = admin(other, "POST", f"/keys/{created['key_id']}/revoke")
    assert revoked["revoked_at"] is not None and status_of(other, key) == 401
    refused_s = until(lambda: status_of(made_on, key) == 401, "the revocation on the first gateway")
    print(f"new key seen by the other gateway after {seen_s * 1000:.0f} ms; revocation after "
          f"{refused_s * 1000:.0f} ms (polling every 20 ms)")


def test_a_budget_spent_through_both_gateways_is_exact(gateways, postgres_database):
    import psycopg

    first, second = gateways
    created = admin(first, "POST", "/keys", json={"name": "budget", "budget_usd": BUDGET_USD})
    key, key_id = created["key"], created["key_id"]
    # Refused until the second gateway knows the key (a 401 spends nothing).
    until(lambda: httpx.get(f"{second.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                            timeout=10).status_code == 200, "the key on the second gateway")

    async def burst() -> list[httpx.Response]:
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
                "stream": True}
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=NUM_CALLS),
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            return await asyncio.gather(*(client.post(f"{(first, second)[i % 2].base_url}/v1/chat/completions",
                                                      json=body) for i in range(NUM_CALLS)))

    responses = asyncio.run(burst())
    statuses = [response.status_code for response in responses]
    num_fit = int(BUDGET_USD * 1e9) // CALL_NANOS  # 12 calls of $0.004 in $0.05
    assert statuses.count(200) == num_fit and statuses.count(429) == NUM_CALLS - num_fit, statuses
    assert {statuses[i] for i in range(0, NUM_CALLS, 2)} | {statuses[i] for i in range(1, NUM_CALLS, 2)} == {200, 429}
    for response in responses:
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "insufficient_quota"

    def spent() -> tuple[int, int]:
        with psycopg.connect(postgres_database) as conn:
            row = conn.execute("SELECT count(*), COALESCE(SUM(cost_usd), 0) FROM usage_ledger WHERE key_id = %s",
                               (key_id,)).fetchone()
        assert row is not None
        return row[0], round(row[1] * 1e9)

    until(lambda: spent()[0] == NUM_CALLS, "every call's ledger row")
    assert spent() == (NUM_CALLS, num_fit * CALL_NANOS)  # the budget, to the nano, and not a call past it
