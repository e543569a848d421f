"""Who may read what, in process: the admin key as Bearer wherever the admin may read (usage,
traces, models, the engine's stats) but never to call a model; an API key sees only the models
it may use (/v1/models, /tokenize) and the engine's load without the replicas' hosts."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tokenway.engine.client import AsyncEngine
from tokenway.server.app import create_app

from .conftest import gateway_services

MODEL = "smollm2-135m-instruct"
SECOND = "second"  # another name for the same local model: a pool a key may be scoped to
ADMIN_KEY = "admin-secret-0123456789"


@pytest.fixture()
def app(llm, tmp_path):
    engine = AsyncEngine(core=llm.engine)
    services = gateway_services(engine, tmp_path, (MODEL, SECOND), admin_key=ADMIN_KEY, observe=True)
    yield create_app(services)
    engine.shutdown()
    services.observer.close()


def requests(app, *calls: tuple[str, str, dict]) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            responses = [await client.request(method, path, **kwargs) for method, path, kwargs in calls]
        await asyncio.sleep(0.05)  # the ledger's writer commits
        return responses

    return asyncio.run(main())


def bearer(secret: str) -> dict:
    return {"headers": {"Authorization": f"Bearer {secret}"}}


def test_the_admin_key_as_bearer_reads_every_keys_usage_and_traces(app):
    keys = app.state.services.gatekeeper.keys
    secret, info = keys.create(name="user")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    served, = requests(app, ("POST", "/v1/chat/completions", {"json": chat, **bearer(secret)}))
    assert served.status_code == 200
    request_id = served.headers["x-request-id"]
    named, every, trace, traces, models, stats = requests(
        app, ("GET", f"/v1/usage?key_id={info.key_id}", bearer(ADMIN_KEY)), ("GET", "/v1/usage", bearer(ADMIN_KEY)),
        ("GET", f"/v1/traces/{request_id}", bearer(ADMIN_KEY)), ("GET", "/v1/traces", bearer(ADMIN_KEY)),
        ("GET", "/v1/models", bearer(ADMIN_KEY)), ("GET", "/engine/stats", bearer(ADMIN_KEY)))
    assert named.status_code == 200 and [row["key_id"] for row in named.json()["data"]] == [info.key_id]
    assert every.status_code == 200 and info.key_id in {row["key_id"] for row in every.json()["data"]}
    assert trace.status_code == 200 and trace.json()["request_id"] == request_id
    assert request_id in {t["request_id"] for t in traces.json()["data"]}
    assert {m["id"] for m in models.json()["data"]} == {MODEL, SECOND}
    assert stats.status_code == 200 and stats.json()["replicas"]["local"]["local"]["kind"] == "engine"
    # The same through x-api-key beside a user key (the way that worked before) still does.
    both, = requests(app, ("GET", f"/v1/usage?key_id={info.key_id}",
                           {"headers": {"Authorization": f"Bearer {secret}", "x-api-key": ADMIN_KEY}}))
    assert both.status_code == 200


def test_the_admin_key_calls_no_model(app):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused, = requests(app, ("POST", "/v1/chat/completions", {"json": chat, **bearer(ADMIN_KEY)}))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_not_for_calls"


def test_a_user_key_reads_only_its_own(app):
    keys = app.state.services.gatekeeper.keys
    secret, info = keys.create(name="user")
    other_secret, other = keys.create(name="other")
    other_usage, own_usage, stats = requests(
        app, ("GET", f"/v1/usage?key_id={other.key_id}", bearer(secret)), ("GET", "/v1/usage", bearer(secret)),
        ("GET", "/engine/stats", bearer(secret)))
    assert other_usage.status_code == 403
    assert own_usage.status_code == 200
    # The engine's load, and each pool's as totals: no replica, no host.
    assert stats.status_code == 200
    assert stats.json()["replicas"] == {"local": {"num_replicas": 1, "num_available": 1, "num_in_flight": 0,
                                                  "num_outstanding_tokens": 0}}
    unauthenticated, = requests(app, ("GET", "/engine/stats", {}))
    assert unauthenticated.status_code == 401


def test_a_key_scoped_to_one_model_sees_and_tokenizes_only_that_one(app):
    keys = app.state.services.gatekeeper.keys
    secret, _ = keys.create(name="scoped", models=[SECOND])
    models, chat_card, tokenize_default, tokenize_chat, detokenize = requests(
        app, ("GET", "/v1/models", bearer(secret)), ("GET", f"/v1/models/{MODEL}", bearer(secret)),
        ("POST", "/tokenize", {"json": {"prompt": "hi"}, **bearer(secret)}),
        ("POST", "/tokenize", {"json": {"model": MODEL, "prompt": "hi"}, **bearer(secret)}),
        ("POST", "/detokenize", {"json": {"model": MODEL, "tokens": [1, 2]}, **bearer(secret)}))
    assert [m["id"] for m in models.json()["data"]] == [SECOND]
    for refused in (chat_card, tokenize_default, tokenize_chat, detokenize):
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed", refused.text
