"""The stored responses' upkeep in a server without a model (test_responses_background.py's
replica and services): a background response its server left running (its lease passed) is
stored failed at start, while one this server runs keeps its lease; stored responses older
than the TTL are purged. And a safety refusal on /v1/responses names the Responses field."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from functools import partial

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.billing.record import UsageRecord
from tokenway.conversations import ResponseUsage, StoredResponse, open_response_store
from tokenway.gateway.auth import ANONYMOUS
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.observability.observer import Observer
from tokenway.routing.router import Pool, Router
from tokenway.safety.screen import SafetyPolicy
from tokenway.server.responses_background import bill_abandoned
from tokenway.server.responses_tasks import ABANDONED
from tokenway.server.services import ModelCatalog, ServerConfig, Services

from .test_responses_background import BODY, MODEL, EndlessReplica, ledger_row, session, until


@pytest.fixture()
def served(tmp_path):
    """As test_responses_background.py's: services on an EndlessReplica, a real ledger, an
    in-memory response store."""
    replica = EndlessReplica()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    gatekeeper = Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger, PriceTable.from_config({}),
                            Defaults(), host="127.0.0.1")
    services = Services.build(ServerConfig(served_model_names=(MODEL,)), ModelCatalog(
        (MODEL,), context_windows={MODEL: 4096}), Router({MODEL: Pool.of(MODEL, [replica])}), gatekeeper=gatekeeper,
        response_store=open_response_store("memory"))
    yield services, replica
    asyncio.run(services.response_store.close())


def left_running(response_id: str, lease_until: float | None, created_at: float | None = None) -> StoredResponse:
    """A background response as a server that stopped left it."""
    response = {"id": response_id, "object": "response", "status": "in_progress", "background": True, "output": [],
                "error": None, "model": MODEL}
    return StoredResponse(response_id, ANONYMOUS.key_id, created_at or time.time(), "in_progress", MODEL, None, None,
                          (), response, {}, lease_until)


async def status_of(client, response_id: str) -> str:
    return (await client.get(f"/v1/responses/{response_id}")).json()["status"]


def test_a_response_whose_server_stopped_is_failed_and_one_running_here_keeps_its_lease(served):
    services, replica = served
    store = services.response_store

    async def steps(client):
        await store.create(left_running("resp_left", lease_until=time.time() - 1))
        # Stored by a server from before leases, two hours ago.
        await store.create(left_running("resp_unleased", lease_until=None, created_at=time.time() - 7200))
        services.background.start(store, lease_s=1.0)
        queued = (await client.post("/v1/responses", json=BODY)).json()
        await until(lambda: services.background.num_running == 1 and services.capacity.num_in_flight == 1)
        for _ in range(400):
            if await status_of(client, "resp_left") == "failed":
                break
            await asyncio.sleep(0.01)
        left = (await client.get("/v1/responses/resp_left")).json()
        unleased = await status_of(client, "resp_unleased")
        await asyncio.sleep(2.5)  # its lease (1 s) would have passed thrice without renewals
        running = await status_of(client, queued["id"])
        await client.post(f"/v1/responses/{queued['id']}/cancel")
        await services.background.aclose()
        return left, unleased, running

    left, unleased, running = session(services, steps)
    assert left["status"] == "failed" and left["error"] == {"code": "server_error", "message": ABANDONED}
    assert unleased == "failed"
    assert running == "in_progress"


def test_responses_older_than_the_ttl_are_purged_at_start(served):
    services, _ = served
    store = services.response_store
    done = dataclasses.replace(left_running("resp_done", None), status="completed",
                               response={"id": "resp_done", "status": "completed", "output": []})

    async def steps(client):
        await store.create(dataclasses.replace(done, id="resp_aged", response={**done.response, "id": "resp_aged"},
                                               created_at=time.time() - 7200))
        await store.create(done)
        services.background.start(store, ttl_s=3600)
        for _ in range(400):
            if (await client.get("/v1/responses/resp_aged")).status_code == 404:
                break
            await asyncio.sleep(0.01)
        seen = [(await client.get(f"/v1/responses/{rid}")).status_code for rid in ("resp_aged", "resp_done")]
        await services.background.aclose()
        return seen

    assert session(services, steps) == [404, 200]


def test_a_background_response_writes_one_ledger_row_and_one_trace(served):
    services, replica = served
    services = dataclasses.replace(services, observer=Observer(lambda: None))
    replica.words = 5

    async def steps(client):
        queued = (await client.post("/v1/responses", json=BODY)).json()
        await until(lambda: services.background.num_running == 0)
        await ledger_row(services, queued["id"])
        return queued["id"], await services.gatekeeper.ledger.recent(10)

    response_id, rows = session(services, steps)
    assert [(row.request_id, row.status, row.completion_tokens) for row in rows] == [(response_id, 200, 5)]
    traces = services.observer.traces.recent(10)
    assert [(trace.request_id, trace.status, trace.completion_tokens) for trace in traces] == [(response_id, 200, 5)]


def test_a_safety_refusal_names_the_input(served):
    services, _ = served
    blocking = dataclasses.replace(services, settings=dataclasses.replace(
        services.settings, safety=SafetyPolicy(input="block")))

    async def steps(client):
        card = "Charge my card 4111 1111 1111 1111 please."
        return [(await client.post("/v1/responses", json=body)).json()["error"] for body in (
            {"model": MODEL, "input": card}, {"model": MODEL, "input": [{"role": "user", "content": card}]},
            {"model": MODEL, "input": "hi", "background": True, "instructions": card})]

    for error in session(blocking, steps):
        assert (error["code"], error["param"]) == ("content_policy_violation", "input")


# $0.001 a prompt token, $0.0005 a cached one, $0.002 a completion token (USD per million).
PRICES = {MODEL: {"input": 1000.0, "cached_input": 500.0, "output": 2000.0}}


@pytest.fixture()
def priced(tmp_path):
    """The served fixture's services with prices, and a key with a $1 budget."""
    replica = EndlessReplica()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    gatekeeper = Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger,
                            PriceTable.from_config(PRICES), Defaults(), host="127.0.0.1")
    secret, key = gatekeeper.keys.create("budgeted", budget_usd=1.0)
    services = Services.build(ServerConfig(served_model_names=(MODEL,)), ModelCatalog(
        (MODEL,), context_windows={MODEL: 4096}), Router({MODEL: Pool.of(MODEL, [replica])}), gatekeeper=gatekeeper,
        response_store=open_response_store("memory"), observer_for=lambda _: Observer(lambda: None))
    yield services, key.key_id, {"authorization": f"Bearer {secret}"}
    asyncio.run(services.response_store.close())


def test_a_response_whose_server_stopped_is_billed_the_usage_it_kept_once(priced):
    services, key_id, _ = priced
    store, gatekeeper = services.response_store, services.gatekeeper
    budgets, ledger = gatekeeper.budgets, gatekeeper.ledger

    def left(response_id: str, usage: ResponseUsage) -> StoredResponse:
        stored = left_running(response_id, lease_until=time.time() - 1)
        return dataclasses.replace(stored, key_id=key_id, response={**stored.response, "service_tier": "default"},
                                   prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                                   completion_tokens=usage.completion_tokens)

    async def steps(_):
        # One whose server wrote its row, then stopped before storing its end: billed once only.
        await ledger.record(UsageRecord("resp_billed", key_id, MODEL, 10, 0, 20, 0.05, "stop", None, 200, {},
                                        time.time(), time.time()))
        await store.create(left("resp_billed", ResponseUsage(10, 0, 20)))
        await store.create(left("resp_left", ResponseUsage(100, 20, 50)))
        held = (await budgets.reserve(key_id, 10**9, 0)).reservation  # the key seen before: its seed counts $0.05
        assert held is not None
        await budgets.settle(held, 0)
        services.background.start(store, lease_s=1.0, bill=partial(bill_abandoned, services))
        row = await ledger_row(services, "resp_left")
        await until(lambda: services.observer.traces.get("resp_left") is not None)
        await services.background.aclose()
        return row, await budgets.state(key_id), await ledger.recent(10)

    row, budget, rows = session(services, steps)
    assert (row.key_id, row.model, row.status, row.service_tier) == (key_id, MODEL, 500, "default")
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (100, 20, 50)
    assert row.cost_usd == pytest.approx((80 * 1000 + 20 * 500 + 50 * 2000) / 1e6)  # $0.19
    assert sorted(r.request_id for r in rows) == ["resp_billed", "resp_left"]  # no second row for resp_billed
    assert budget.spent_nanos == 240_000_000 and budget.held_nanos == 0  # $0.05 seeded, plus $0.19
    trace = services.observer.traces.get("resp_left")
    assert (trace.status, trace.completion_tokens, trace.cost_usd) == (500, 50, row.cost_usd)


def test_each_renewal_keeps_what_a_running_response_has_generated(priced):
    services, key_id, headers = priced
    store = services.response_store

    async def steps(client):
        services.background.start(store, lease_s=0.3, bill=partial(bill_abandoned, services))
        # Its worst case within the $1 budget: 100 output tokens at $0.002.
        queued = (await client.post("/v1/responses", json={**BODY, "max_output_tokens": 100},
                                    headers=headers)).json()
        kept = []

        async def renewed() -> bool:
            stored = await store.get(queued["id"], key_id)
            kept.append(stored.usage)
            return stored.completion_tokens > 0

        for _ in range(400):
            if await renewed():
                break
            await asyncio.sleep(0.01)
        await client.post(f"/v1/responses/{queued['id']}/cancel", headers=headers)
        await services.background.aclose()
        return kept[-1]

    usage = session(services, steps)
    assert usage.completion_tokens > 0 and usage.prompt_tokens > 0, usage
