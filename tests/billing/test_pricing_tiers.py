"""Prices per service tier: a tier's own price where the config gives one, else the model's
default price times the tier's multiplier; both from serve's [prices] and a [[models]] entry."""

import pytest

from tokenway.billing.pricing import DEFAULT_TIER_MULTIPLIERS, ModelPrice, PriceTable
from tokenway.routing.registry import Registry

PRICES = {"m": {"input": 2.0, "cached_input": 0.5, "output": 8.0, "priority": {"input": 5.0, "output": 20.0}}}


def test_a_tier_without_its_own_price_costs_the_default_price_times_its_multiplier():
    table = PriceTable.from_config(PRICES)
    assert dict(DEFAULT_TIER_MULTIPLIERS) == {"priority": 1.0, "flex": 0.5, "batch": 0.5}
    assert table.price("m", "flex") == ModelPrice(1.0, 0.25, 4.0)
    assert table.price("m", "batch") == ModelPrice(1.0, 0.25, 4.0)
    assert table.cost_usd("m", 1_000_000, 0, 1_000_000) == 10.0
    assert table.cost_usd("m", 1_000_000, 0, 1_000_000, service_tier="flex") == 5.0
    assert table.cost_usd("unpriced", 1000, 0, 1000, service_tier="priority") == 0.0


def test_a_tiers_own_price_wins_over_the_multiplier():
    table = PriceTable.from_config(PRICES, {"priority": 3.0})
    assert table.price("m", "priority") == ModelPrice(5.0, 0.0, 20.0)  # missing fields are 0, as for any price
    assert table.cost_usd("m", 1_000_000, 0, 1_000_000, service_tier="priority") == 25.0


def test_configured_multipliers_replace_the_defaults_they_name():
    table = PriceTable.from_config({"m": {"input": 2.0, "output": 8.0}}, {"batch": 0.25, "priority": 2.0})
    assert table.price("m", "batch") == ModelPrice(0.5, 0.0, 2.0)
    assert table.price("m", "priority") == ModelPrice(4.0, 0.0, 16.0)
    assert table.price("m", "flex") == ModelPrice(1.0, 0.0, 4.0)  # still the default 0.5


@pytest.mark.parametrize("prices, multipliers, message", [
    ({"m": {"default": {"input": 1.0}}}, None, "unknown field"),  # the model's own price is the default tier's
    ({"m": {"flex": {"input": -1.0}}}, None, "input"),
    ({"m": {"flex": {"inputs": 1.0}}}, None, "prices.m.flex"),
    ({"m": {"flex": 0.5}}, None, "prices.m.flex"),
    ({}, {"gold": 0.5}, "tier_price_multipliers.gold"),
    ({}, {"flex": -0.5}, "tier_price_multipliers.flex"),
    ({}, {"flex": float("inf")}, "tier_price_multipliers.flex"),
])
def test_a_bad_tier_price_is_refused_naming_it(prices, multipliers, message):
    with pytest.raises(ValueError, match=message):
        PriceTable.from_config(prices, multipliers)


def test_a_models_entry_prices_its_tiers_in_tables_of_their_own():
    def registry(prices: dict) -> Registry:
        return Registry.from_config({"models": [{"name": "a", "replicas": [{"kind": "local"}], "prices": prices}]},
                                    default_model="smollm2-135m-instruct")

    table = registry({"input": 1.0, "output": 4.0, "batch": {"input": 0.1, "output": 0.4}}).price_table(
        None, {"flex": 0.75})
    assert table.price("a", "batch") == ModelPrice(0.1, 0.0, 0.4)
    assert table.price("a", "flex") == ModelPrice(0.75, 0.0, 3.0)
    with pytest.raises(ValueError, match=r"models\[0\].prices.flex: unknown key 'gold'"):
        registry({"input": 1.0, "flex": {"gold": 1.0}})
