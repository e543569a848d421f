"""Service tiers end to end, on a real server with the official SDKs: a key without the tier
asked gets a 403 the SDK raises as PermissionDeniedError; a key granted it (by the keys CLI)
gets the tier in the SDK's service_tier, its ledger row costs the tier's price from the config,
and `tokenway usage` shows each tier apart."""

from __future__ import annotations

import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from .conftest import REPO, Server
from .test_gateway_policy import MODEL, create_key, wait_for

# USD per million tokens: priority has a price of its own, flex is the default times the
# configured multiplier (0.25), batch the default multiplier (0.5).
CONFIG = f"""tier_price_multipliers = {{ flex = 0.25 }}
[prices."{MODEL}"]
input = 1000.0
output = 2000.0
[prices."{MODEL}".priority]
input = 3000.0
output = 9000.0
"""
TIER_TO_PRICE = {"default": (1000.0, 2000.0), "flex": (250.0, 500.0), "priority": (3000.0, 9000.0)}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiered(default_model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    config.write_text(CONFIG)
    server = Server("--config", str(config), "--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def keys(tiered) -> dict[str, str]:
    """Keys made by the CLI, once the server sees them (and so has auth on): the server's grant,
    flex only, and default, flex and priority."""
    name_to_key = {"plain": create_key(tiered.db, "--name", "plain"),
                   "flex-only": create_key(tiered.db, "--name", "flex-only", "--tiers", "flex"),
                   "all": create_key(tiered.db, "--name", "all", "--tiers", "default,flex,priority")}
    # The key cache reloads the whole table when auth turns on: every key is known from then.
    assert wait_for(lambda: httpx.get(f"{tiered.base_url}/v1/models", timeout=10).status_code == 401)
    for key in name_to_key.values():
        assert httpx.get(f"{tiered.base_url}/v1/models", timeout=10,
                         headers={"Authorization": f"Bearer {key}"}).status_code == 200
    return name_to_key


def clients(server: Server, key: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0),
            anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0))


def test_a_key_without_the_tier_gets_the_sdks_permission_error(tiered, keys):
    plain, _ = clients(tiered, keys["plain"])
    _, flex_only = clients(tiered, keys["flex-only"])
    with pytest.raises(openai.PermissionDeniedError) as chat:
        plain.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, service_tier="priority")
    assert chat.value.code == "service_tier_not_allowed"
    assert "service tier priority; its tiers: default, flex, batch." in chat.value.message
    with pytest.raises(openai.PermissionDeniedError) as response:
        plain.responses.create(model=MODEL, input="hi", max_output_tokens=2, service_tier="priority")
    assert response.value.code == "service_tier_not_allowed"
    with pytest.raises(anthropic.PermissionDeniedError, match="its tiers: flex"):
        flex_only.messages.create(model=MODEL, messages=HI, max_tokens=2)


def test_a_granted_tier_is_the_sdks_service_tier_and_bills_the_tiers_price(tiered, keys):
    key = keys["all"]
    oai, claude = clients(tiered, key)
    flex = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, service_tier="flex")
    auto = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    priority = oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, service_tier="priority")
    message = claude.messages.create(model=MODEL, messages=HI, max_tokens=2)
    assert (flex.service_tier, auto.service_tier, priority.service_tier) == ("flex", "default", "priority")
    assert message.usage.service_tier == "priority"  # Anthropic's auto, where the key has priority
    for request_id, tier in ((flex.id, "flex"), (auto.id, "default"), (priority.id, "priority"),
                             (message.id, "priority")):
        row = tiered.ledger_row(request_id)
        assert row["service_tier"] == tier and row["completion_tokens"] > 0
        input_price, output_price = TIER_TO_PRICE[tier]
        num_uncached = row["prompt_tokens"] - row["cached_tokens"]  # cached input is priced 0 at every tier
        assert row["cost_usd"] == pytest.approx(
            (num_uncached * input_price + row["completion_tokens"] * output_price) / 1e6, rel=1e-12)

    usage = subprocess.run([sys.executable, "-m", "tokenway.cli", "usage", "--db", str(tiered.db), "--key-id",
                            key.split("-")[1]], capture_output=True, text=True, cwd=REPO, check=True).stdout
    header, *lines = usage.splitlines()
    assert header.split()[3] == "service_tier"
    assert sorted(line.split()[3] for line in lines) == ["default", "flex", "priority"]
