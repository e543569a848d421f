"""Budgets and refusals end to end, on real servers: a budget holds under concurrency, in one
gateway and across two sharing Redis; refused calls (429, 401) get a ledger row that bills
nothing; a max_tokens that can never fit is told what would."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import httpx
import pytest

from .conftest import Server
from .test_gateway_policy import MODEL, create_key, wait_for

# A prompt or completion token costs $0.001 (1,000,000 nanos), cached or not: a call's cost is
# then exactly (prompt + completion tokens) * $0.001, the same as its worst case with ignore_eos.
PRICES = f'[prices."{MODEL}"]\ninput = 1000.0\ncached_input = 1000.0\noutput = 1000.0\n'
NANOS_PER_TOKEN = 1_000_000
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def prices(tmp_path_factory):
    path = tmp_path_factory.mktemp("prices") / "prices.toml"
    path.write_text(PRICES)
    return path


@pytest.fixture(scope="module")
def priced(default_model_dir, prices):
    server = Server("--config", str(prices), "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


def key_rows(db, key_id: str) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM usage_ledger WHERE key_id = ?", (key_id,))]


def key_id_of(key: str) -> str:
    return key.split("-")[1]


def burst(base_urls: list[str], key: str, num_calls: int, body: dict = BODY) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=num_calls),
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            return await asyncio.gather(*(client.post(f"{base_urls[i % len(base_urls)]}/v1/chat/completions",
                                                      json=body) for i in range(num_calls)))

    return asyncio.run(main())


def check_budget_held(responses: list[httpx.Response], rows_of, key: str) -> None:
    statuses = [r.status_code for r in responses]
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert served and refused and len(served) + len(refused) == len(responses), statuses
    num_prompt_tokens = served[0].json()["usage"]["prompt_tokens"]
    call_nanos = (num_prompt_tokens + BODY["max_tokens"]) * NANOS_PER_TOKEN
    # Every call costs its worst case, so no settlement frees anything: exactly as many as fit.
    assert len(served) == 500_000_000 // call_nanos, (len(served), num_prompt_tokens)
    for response in refused:
        error = response.json()["error"]
        assert error["code"] == "insufficient_quota" and "$0.50" in error["message"], error
    rows = wait_for(lambda: rows if len(rows := rows_of()) == len(responses) else None, timeout=10)
    assert rows is not None and len(rows) == len(responses)
    spent_nanos = sum(round(r["cost_usd"] * 1e9) for r in rows)
    assert spent_nanos == len(served) * call_nanos <= 500_000_000  # the budget, to the nano
    for row in rows:
        if row["status"] == 429:
            assert row["cost_usd"] == 0 and row["prompt_tokens"] == row["completion_tokens"] == 0
            assert json.loads(row["trace"])["limit_kind"] == "budget" and "budget" in row["error"]


def test_fifty_concurrent_calls_never_spend_past_the_budget(priced):
    key = create_key(priced.db, "--name", "budget-burst", "--budget-usd", "0.5")
    # The server's first key turns auth on within ~2 s; until then every call is anonymous
    # (no budget), so wait until a call without the key is refused.
    assert wait_for(lambda: httpx.get(f"{priced.base_url}/v1/models", timeout=10).status_code == 401)
    responses = burst([priced.base_url], key, 50)
    check_budget_held(responses, lambda: key_rows(priced.db, key_id_of(key)), key)


def test_two_gateways_sharing_redis_hold_one_budget(default_model_dir, prices, redis_url, tmp_path):
    db = tmp_path / "shared.db"
    key = create_key(db, "--name", "shared-budget", "--budget-usd", "0.5")
    servers = [Server("--config", str(prices), "--no-embeddings", "--limits-url", redis_url, db=db)
               for _ in range(2)]
    try:
        responses = burst([s.base_url for s in servers], key, 50)
        check_budget_held(responses, lambda: key_rows(db, key_id_of(key)), key)
        assert {r.status_code for r in responses[0::2]} | {r.status_code for r in responses[1::2]} == {200, 429}
    finally:
        for server in servers:
            assert server.stop() == 0, server.read_log()[-3000:]


def test_a_max_tokens_that_can_never_fit_is_told_what_would(priced):
    key = create_key(priced.db, "--name", "budget-fit", "--budget-usd", "0.05")  # 50 tokens' worth
    headers = {"Authorization": f"Bearer {key}"}
    wait_for(lambda: httpx.get(f"{priced.base_url}/v1/models", timeout=10, headers=headers).status_code == 200)
    num_prompt_tokens = httpx.post(f"{priced.base_url}/tokenize", headers=headers, timeout=60, json={
        "model": MODEL, "messages": BODY["messages"]}).json()["count"]
    too_many = httpx.post(f"{priced.base_url}/v1/chat/completions", headers=headers, timeout=60,
                          json={**BODY, "max_tokens": 100})
    assert too_many.status_code == 429 and "retry-after" not in too_many.headers
    fit = 50 - num_prompt_tokens
    assert too_many.json()["error"]["message"].endswith(
        f"more than the $0.05 that remains of this API key's $0.05 budget; lower max_tokens to {fit} or less.")
    exact = httpx.post(f"{priced.base_url}/v1/chat/completions", headers=headers, timeout=60,
                       json={**BODY, "max_tokens": fit})
    assert exact.status_code == 200 and exact.json()["usage"]["total_tokens"] == 50
    spent = httpx.post(f"{priced.base_url}/v1/chat/completions", headers=headers, timeout=60, json=BODY)
    assert spent.status_code == 429
    assert spent.json()["error"]["message"] == (
        "This API key has used its budget: $0.05 of $0.05 spent, nothing remains.")


def test_refused_calls_are_rows_that_bill_nothing(priced):
    key = create_key(priced.db, "--name", "rpm-refusals", "--rpm", "3")
    headers = {"Authorization": f"Bearer {key}"}
    wait_for(lambda: httpx.get(f"{priced.base_url}/v1/models", timeout=10, headers=headers).status_code == 200)
    responses = [httpx.post(f"{priced.base_url}/v1/chat/completions", headers=headers, timeout=60, json=BODY)
                 for _ in range(6)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429, 429]
    rows = [priced.ledger_row(r.headers["x-request-id"]) for r in responses]
    for row in rows[:3]:
        assert row["status"] == 200 and row["cost_usd"] > 0 and row["prompt_tokens"] > 0
    for row in rows[3:]:
        assert row["status"] == 429 and row["key_id"] == key_id_of(key)
        assert row["cost_usd"] == 0 and row["prompt_tokens"] == row["cached_tokens"] == row["completion_tokens"] == 0
        assert row["error"].startswith("Rate limit reached for requests")
        assert json.loads(row["trace"])["limit_kind"] == "requests"


@pytest.mark.parametrize("secret,key_id", [("tw-k_0badc0de-notthesecretatall", "k_0badc0de"),
                                           ("not-one-of-ours", "")])
def test_a_401_is_a_row_under_the_key_the_secret_names(priced, secret, key_id):
    create_key(priced.db, "--name", "auth-on")  # auth stays on whatever runs first
    def refused() -> httpx.Response | None:
        response = httpx.post(f"{priced.base_url}/v1/chat/completions", json=BODY, timeout=60,
                              headers={"Authorization": f"Bearer {secret}"})
        return response if response.status_code == 401 else None

    response = wait_for(refused)
    assert response is not None and response.status_code == 401
    row = priced.ledger_row(response.headers["x-request-id"])
    assert row["status"] == 401 and row["key_id"] == key_id and row["cost_usd"] == 0
    assert row["prompt_tokens"] == row["completion_tokens"] == 0
    assert row["error"] == response.json()["error"]["message"]
