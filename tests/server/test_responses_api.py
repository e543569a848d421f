"""/v1/responses in process on the session's fp32 engine, with keys, a real SQLite ledger and
an in-memory response store: the gateway applies as to chat (one ledger row a call, under the
response's id), stored responses belong to their key, and truncation auto fits a conversation
into the window in O(log n) templatings. Background responses: test_responses_background.py."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import httpx
import pytest

from tokenway.conversations import open_response_store
from tokenway.engine.client import AsyncEngine
from tokenway.frontend.model import ModelFrontend
from tokenway.server import prepare, responses_prepare
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog

from .conftest import gateway_services

MODEL = "smollm2-135m-instruct"


@pytest.fixture()
def services(llm, tmp_path):
    engine = AsyncEngine(core=llm.engine)
    services = dataclasses.replace(gateway_services(engine, tmp_path), response_store=open_response_store("memory"))
    yield services
    asyncio.run(services.response_store.close())
    engine.shutdown()


def keys(services, *names: str) -> list[dict[str, str]]:
    return [{"Authorization": f"Bearer {services.gatekeeper.keys.create(name=name)[0]}"} for name in names]


def session(services, steps):
    """Run `steps(client)` against the app on one event loop (a background response outlives its POST)."""
    async def main():
        transport = httpx.ASGITransport(app=create_app(services))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await steps(client)

    return asyncio.run(main())


async def ledger_row(services, request_id: str):
    for _ in range(200):  # the writer commits in the background
        row = await services.gatekeeper.ledger.get(request_id)
        if row is not None:
            return row
        await asyncio.sleep(0.02)
    return None


def test_each_response_is_one_ledger_row_under_its_id_billed_as_its_usage(services):
    [auth] = keys(services, "a")

    async def steps(client):
        body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 6, "temperature": 0}
        created = await client.post("/v1/responses", json=body, headers=auth)
        streamed = await client.post("/v1/responses", json={**body, "stream": True}, headers=auth)
        counted = await client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Say hi."},
                                    headers=auth)
        response = created.json()
        final = [line for line in streamed.text.splitlines()
                 if line in ("event: response.completed", "event: response.incomplete")]
        return response, created.headers["x-request-id"], streamed.headers["x-request-id"], final, counted.json(), [
            await ledger_row(services, response["id"]), await ledger_row(services, streamed.headers["x-request-id"])]

    response, created_id, streamed_id, final, counted, rows = session(services, steps)
    assert created_id == response["id"] and streamed_id.startswith("resp_") and len(final) == 1
    assert counted == {"object": "response.input_tokens", "input_tokens": response["usage"]["input_tokens"]}
    row, streamed_row = rows
    usage = response["usage"]
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.status) == (
        usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"], 200)
    assert row.trace["endpoint"] == "/v1/responses" and streamed_row.status == 200 and streamed_row.trace["stream"]


def test_a_stored_response_is_its_keys_alone(services):
    owner, other = keys(services, "owner", "other")

    async def steps(client):
        created = (await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3},
                                     headers=owner)).json()
        path = f"/v1/responses/{created['id']}"
        seen = [(await client.get(path, headers=headers)).status_code for headers in (other, owner)]
        seen.append((await client.get(f"{path}/input_items", headers=other)).status_code)
        continued = await client.post("/v1/responses", headers=other, json={
            "model": MODEL, "input": "And?", "previous_response_id": created["id"], "max_output_tokens": 3})
        seen += [(await client.post(f"{path}/cancel", headers=other)).status_code,
                 (await client.delete(path, headers=other)).status_code,
                 (await client.get(path, headers=owner)).status_code,
                 (await client.delete(path, headers=owner)).status_code,
                 (await client.get(path, headers=owner)).status_code]
        return seen, continued

    seen, continued = session(services, steps)
    # Another key's response is a 404 as one that never was: even its deletion cannot tell it exists.
    assert seen == [404, 200, 404, 404, 404, 200, 200, 404]
    assert continued.status_code == 400 and continued.json()["error"]["param"] == "previous_response_id"


TURN = "Tell me about the city of Lyon, its two rivers, its silk and its food. " * 3
SMALL_WINDOW = 1024  # a conversation over it is quick to build, and its fitted prompt quick to prefill


@pytest.fixture()
def small_window(services, default_model_dir):
    """The same services with the model's window cut to SMALL_WINDOW at the gateway."""
    frontend = ModelFrontend.from_dir(default_model_dir, max_model_len=SMALL_WINDOW)
    return dataclasses.replace(services, catalog=ModelCatalog.local(frontend, (MODEL,)))


def test_truncation_auto_drops_the_oldest_turns_in_log_n_templatings(small_window, monkeypatch):
    num_templatings, jobs = [0], []
    for module in (prepare, responses_prepare):
        original = module.template_chat

        def counted(*args, original=original, **kwargs):
            num_templatings[0] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, "template_chat", counted)
    original_prepared = responses_prepare.prepared

    def prepared(services_, call, job, *args, **kwargs):
        jobs.append(job)
        return original_prepared(services_, call, job, *args, **kwargs)

    monkeypatch.setattr(responses_prepare, "prepared", prepared)
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {TURN}"} for i in range(63)]
    body = {"model": MODEL, "instructions": "Answer in one word.", "input": items, "max_output_tokens": 4}

    async def steps(client):
        refused = await client.post("/v1/responses", json=body)
        num_refused, num_templatings[0] = num_templatings[0], 0
        fitted = await client.post("/v1/responses", json={**body, "truncation": "auto"})
        return refused, num_refused, fitted, num_templatings[0]

    refused, num_refused, fitted, num_fitted = session(small_window, steps)
    error = refused.json()["error"]
    assert refused.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "input")
    assert num_refused == 1
    assert fitted.status_code == 200, fitted.text
    usage = fitted.json()["usage"]
    assert SMALL_WINDOW - 2 * len(TURN) // 3 < usage["input_tokens"] and usage["input_tokens"] + 4 <= SMALL_WINDOW
    # The whole once, the binary search over the 62 messages that may go, the fitted one once more.
    assert num_fitted <= 2 + math.ceil(math.log2(62)) + 1
    # The instructions stay first, the newest turn last; the oldest are gone.
    messages = jobs[-1].messages
    assert messages[0] == {"role": "system", "content": "Answer in one word."}
    assert messages[-1]["content"].startswith("62: ") and int(messages[1]["content"].split(":")[0]) > 0
