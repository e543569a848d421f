"""Background responses (background: true) without a model: a replica that writes until it is
stopped, a real gatekeeper with its SQLite ledger, and an in-memory response store. The POST
answers queued at once; the response runs detached and is polled; a cancel stops its
generation (the replica's stream is closed) and stays cancelled; at shutdown every one still
running is stored as failed; each is billed under its id as it ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.conversations import open_response_store
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, Usage
from tokenway.routing.router import Pool, Router
from tokenway.server.app import create_app
from tokenway.server.responses_background import SHUTDOWN
from tokenway.server.services import ModelCatalog, ServerConfig, Services

MODEL = "endless"


class EndlessReplica:
    """Writes a word every few milliseconds until its stream is closed, or `words` of them."""

    kind = "openai"
    name = "endless"

    def __init__(self) -> None:
        self.words: int | None = None  # None: never ends by itself
        self.num_closed = 0  # streams closed before their end: generations stopped

    async def generate(self, job: GenerationJob) -> AsyncIterator[ReplicaEvent]:
        num_words, ended = 0, False
        try:
            while self.words is None or num_words < self.words:
                num_words += 1
                last = num_words == self.words
                yield ChoiceDelta(0, text=" word", token_ids=(7,), finish_reason="stop" if last else None)
                await asyncio.sleep(0.002)
            yield Usage(prompt_tokens=5, completion_tokens=num_words)
            ended = True
        finally:  # closed, or cancelled where it waits: stopped either way
            self.num_closed += not ended

    async def probe(self) -> bool:
        return True

    def stats(self) -> dict:
        return {}

    async def aclose(self) -> None:
        pass


@pytest.fixture()
def served(tmp_path):
    replica = EndlessReplica()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    gatekeeper = Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger, PriceTable.from_config({}),
                            Defaults(), host="127.0.0.1")
    services = Services.build(ServerConfig(served_model_names=(MODEL,)), ModelCatalog(
        (MODEL,), context_windows={MODEL: 4096}), Router({MODEL: Pool.of(MODEL, [replica])}), gatekeeper=gatekeeper,
        response_store=open_response_store("memory"))
    yield services, replica
    asyncio.run(services.response_store.close())


def session(services, steps):
    """steps(client) on one event loop: a background response outlives the POST that made it."""
    async def main():
        transport = httpx.ASGITransport(app=create_app(services))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await steps(client)

    return asyncio.run(main())


async def until(predicate) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out waiting")


async def ledger_row(services, request_id: str):
    for _ in range(400):
        row = await services.gatekeeper.ledger.get(request_id)
        if row is not None:
            return row
        await asyncio.sleep(0.01)
    return None


BODY = {"model": MODEL, "input": "Go on.", "background": True}


def test_a_background_response_is_queued_then_polled_to_its_end(served):
    services, replica = served
    replica.words = 40

    async def steps(client):
        queued = await client.post("/v1/responses", json=BODY)
        path = f"/v1/responses/{queued.json()['id']}"
        statuses = [queued.json()["status"]]
        while statuses[-1] not in ("completed", "failed"):
            statuses.append((await client.get(path)).json()["status"])
            await asyncio.sleep(0.005)
        final = (await client.get(path)).json()
        return queued, statuses, final, await ledger_row(services, final["id"])

    queued, statuses, final, row = session(services, steps)
    assert queued.status_code == 200 and queued.json()["output"] == [] and queued.json()["background"] is True
    assert queued.headers["x-request-id"] == final["id"]
    assert statuses[0] == "queued" and "in_progress" in statuses and statuses[-1] == "completed"
    assert final["output"][0]["content"][0]["text"] == " word" * 40 and final["usage"]["output_tokens"] == 40
    assert (row.status, row.completion_tokens, row.trace["endpoint"]) == (200, 40, "/v1/responses")


def test_cancel_stops_a_background_responses_generation_and_it_stays_cancelled(served):
    services, replica = served

    async def steps(client):
        queued = (await client.post("/v1/responses", json=BODY)).json()
        path = f"/v1/responses/{queued['id']}"
        await until(lambda: services.capacity.num_in_flight == 1)  # generating
        cancelled = await client.post(f"{path}/cancel")
        await until(lambda: services.background.num_running == 0)
        return cancelled.json(), (await client.get(path)).json(), (await client.post(f"{path}/cancel")).json(), \
            services.capacity.num_in_flight, await ledger_row(services, queued["id"])

    cancelled, stored, again, num_in_flight, row = session(services, steps)
    assert cancelled["status"] == stored["status"] == again["status"] == "cancelled"
    assert replica.num_closed == 1 and num_in_flight == 0  # the replica's stream was closed: no more generating
    assert row.status == 499 and row.error == "cancelled" and row.completion_tokens > 0


def test_only_a_background_response_can_be_cancelled_and_a_finished_one_stays_as_it_is(served):
    services, replica = served
    replica.words = 3

    async def steps(client):
        plain = (await client.post("/v1/responses", json={**BODY, "background": False})).json()
        refused = await client.post(f"/v1/responses/{plain['id']}/cancel")
        done = (await client.post("/v1/responses", json=BODY)).json()
        await until(lambda: services.background.num_running == 0)
        return refused, (await client.post(f"/v1/responses/{done['id']}/cancel")).json(), \
            (await client.post("/v1/responses/resp_nothere/cancel")).status_code

    refused, finished, missing = session(services, steps)
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    assert finished["status"] == "completed" and missing == 404


def test_at_shutdown_a_running_background_response_is_stored_failed_and_billed(served):
    services, replica = served

    async def steps(client):
        queued = (await client.post("/v1/responses", json=BODY)).json()
        await until(lambda: services.capacity.num_in_flight == 1)
        await services.background.aclose()
        stored = (await client.get(f"/v1/responses/{queued['id']}")).json()
        refused = await client.post("/v1/responses", json=BODY)
        return stored, refused, await ledger_row(services, queued["id"])

    stored, refused, row = session(services, steps)
    assert stored["status"] == "failed" and stored["error"] == {"code": "server_error", "message": SHUTDOWN}
    assert replica.num_closed == 1
    assert row.status == 499 and row.error == "server shut down"
    assert refused.status_code == 503 and "retry-after" in refused.headers


def test_a_background_response_refused_by_its_limits_is_a_429_to_its_post(served, tmp_path):
    services, _ = served
    secret, _ = services.gatekeeper.keys.create(name="tiny", tpm=10)

    async def steps(client):
        return await client.post("/v1/responses", json={**BODY, "max_output_tokens": 100},
                                 headers={"Authorization": f"Bearer {secret}"})

    refused = session(services, steps)
    assert refused.status_code == 429 and services.background.num_running == 0
