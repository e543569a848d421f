"""Service tiers through the gateway, in process on the session's engine: a key that lacks the
tier a call asks gets a 403 on every API; a key that has it gets its tier echoed in the API's
words, and its ledger row says the tier and costs the tier's price."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tokenway.billing.pricing import ModelPrice, PriceTable, cost_usd
from tokenway.engine.client import AsyncEngine
from tokenway.server.app import create_app

from .conftest import gateway_services

MODEL = "smollm2-135m-instruct"
ADMIN_KEY = "admin-secret-0123456789"
# The default price, a priority price of its own, and flex and batch at the default multiplier (0.5).
PRICES = PriceTable.from_config({MODEL: {"input": 1000.0, "output": 2000.0,
                                         "priority": {"input": 3000.0, "output": 7000.0}}})
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def app(llm, tmp_path):
    engine = AsyncEngine(core=llm.engine)
    services = gateway_services(engine, tmp_path, admin_key=ADMIN_KEY)
    services.gatekeeper.prices = PRICES
    yield create_app(services)
    engine.shutdown()


def calls(app, *requests: tuple[str, dict, str]) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return [await client.post(path, json=body, headers={"Authorization": f"Bearer {secret}"})
                    for path, body, secret in requests]

    return asyncio.run(main())


def chat(tier: str | None, **fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, **fields,
                                    **({"service_tier": tier} if tier else {})}


def responses(tier: str | None) -> tuple[str, dict]:
    return "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                             **({"service_tier": tier} if tier else {})}


def messages(tier: str | None) -> tuple[str, dict]:
    return "/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 2, **({"service_tier": tier} if tier else {})}


def completions(tier: str | None) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                               **({"service_tier": tier} if tier else {})}


def row_of(app, request_id: str):
    ledger = app.state.services.gatekeeper.ledger
    return asyncio.run(ledger.get(request_id))


def test_a_key_without_the_tier_asked_gets_a_403_on_every_api(app):
    keys = app.state.services.gatekeeper.keys
    plain, _ = keys.create(name="plain")  # the server's grant: default, flex, batch
    default_only, _ = keys.create(name="default-only", service_tiers=["default"])
    flex_only, _ = keys.create(name="flex-only", service_tiers=["flex"])
    refused = calls(app, (*chat("priority"), plain), (*chat("flex"), default_only), (*responses("priority"), plain),
                    (*responses("flex"), default_only), (*completions("priority"), plain),
                    (*messages(None), flex_only), (*messages("standard_only"), flex_only))
    for response in refused[:5]:
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "permission_error", "service_tier_not_allowed", "service_tier")
    assert "service tier priority; its tiers: default, flex, batch." in refused[0].json()["error"]["message"]
    assert "service tier flex; its tiers: default." in refused[1].json()["error"]["message"]
    for response in refused[5:]:  # Anthropic's shape: auto needs priority or standard, which a flex key lacks
        assert response.status_code == 403, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "permission_error"
        assert "its tiers: flex." in body["error"]["message"]
    # A refusal bills nothing: nothing ran.
    row = row_of(app, refused[0].headers["x-request-id"])
    assert row is not None and (row.status, row.cost_usd) == (403, 0.0)


def test_an_unknown_tier_is_a_400_naming_the_field(app):
    secret, _ = app.state.services.gatekeeper.keys.create(name="plain")
    bad_chat, bad_messages = calls(app, (*chat("gold"), secret), (*messages("priority"), secret))
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "service_tier"
    assert bad_messages.status_code == 400 and "service_tier" in bad_messages.json()["error"]["message"]


def test_a_granted_tier_is_echoed_and_billed_at_its_price(app):
    secret, _ = app.state.services.gatekeeper.keys.create(name="all", service_tiers=["default", "flex", "priority"])
    flex, auto, priority, streamed, message, completion = calls(
        app, (*chat("flex"), secret), (*chat(None), secret), (*responses("priority"), secret),
        (*chat("scale", stream=True), secret), (*messages(None), secret), (*completions("flex"), secret))
    for response in (flex, auto, priority, streamed, message, completion):
        assert response.status_code == 200, response.text
    assert flex.json()["service_tier"] == "flex" and auto.json()["service_tier"] == "default"
    assert priority.json()["service_tier"] == "priority" and completion.json()["service_tier"] == "flex"
    chunks = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and all('"service_tier":"priority"' in chunk.replace(" ", "") for chunk in chunks)
    assert message.json()["usage"]["service_tier"] == "priority"  # Anthropic's auto, with priority granted

    for response, tier, price in ((flex, "flex", ModelPrice(500.0, 0.0, 1000.0)),
                                  (auto, "default", ModelPrice(1000.0, 0.0, 2000.0)),
                                  (priority, "priority", ModelPrice(3000.0, 0.0, 7000.0)),
                                  (message, "priority", ModelPrice(3000.0, 0.0, 7000.0))):
        row = row_of(app, response.json()["id"])
        assert row is not None and row.service_tier == tier and row.completion_tokens > 0
        assert row.cost_usd == pytest.approx(cost_usd(price, row.prompt_tokens, row.cached_tokens,
                                                      row.completion_tokens), rel=1e-12)
    usage = asyncio.run(app.state.services.gatekeeper.ledger.usage(None))
    assert {row["service_tier"] for row in usage} == {"default", "flex", "priority"}


def test_the_admin_api_sets_a_keys_tiers(app):
    async def main():
        transport = httpx.ASGITransport(app=app)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.post("/admin/keys", json={"name": "p", "service_tiers": ["priority"]}, headers=admin),
                    await client.post("/admin/keys", json={"name": "q", "service_tiers": ["gold"]}, headers=admin),
                    await client.post("/admin/keys", json={"name": "r", "service_tiers": ["flex", "flex"]},
                                      headers=admin))

    made, unknown, twice = asyncio.run(main())
    assert made.status_code == 201 and made.json()["service_tiers"] == ["priority"]
    assert unknown.status_code == 400 and unknown.json()["error"]["param"].startswith("service_tiers")
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "service_tiers"
    only_priority, = calls(app, (*chat("default"), made.json()["key"]))
    assert only_priority.status_code == 403
