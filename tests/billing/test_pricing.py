import pytest

from tokenway.billing.pricing import ModelPrice, PriceTable, cost_usd

PRICES = {"gpt-x": {"input": 2.0, "cached_input": 0.5, "output": 8.0}, "tiny": {"output": 1.0}}


def test_cost_prices_uncached_cached_and_output_tokens_separately():
    price = ModelPrice(input=2.0, cached_input=0.5, output=8.0)
    # 1,000 prompt tokens of which 400 cached, 250 completion tokens.
    assert cost_usd(price, 1000, 400, 250) == pytest.approx((600 * 2.0 + 400 * 0.5 + 250 * 8.0) / 1e6, rel=1e-15)
    assert cost_usd(price, 1_000_000, 0, 0) == 2.0
    assert cost_usd(price, 1_000_000, 1_000_000, 1_000_000) == 8.5
    assert cost_usd(price, 0, 0, 0) == 0.0


def test_table_from_config_fills_missing_fields_with_zero_and_unknown_models_cost_nothing():
    table = PriceTable.from_config(PRICES)
    assert table.price("gpt-x") == ModelPrice(2.0, 0.5, 8.0)
    assert table.price("tiny") == ModelPrice(0.0, 0.0, 1.0)
    assert table.price("not-configured") == ModelPrice()
    assert "gpt-x" in table and "not-configured" not in table
    assert table.cost_usd("tiny", 5000, 100, 2_000_000) == 2.0
    assert table.cost_usd("not-configured", 5000, 100, 2000) == 0.0
    assert PriceTable.from_config(None).price("any") == ModelPrice()


@pytest.mark.parametrize("config, message", [
    ({"m": {"input": -1.0}}, "input"),
    ({"m": {"output": float("nan")}}, "output"),
    ({"m": {"output": "1.0"}}, "output"),
    ({"m": {"completion": 1.0}}, "unknown field"),
    ({"m": 3.0}, "expected a mapping"),
])
def test_bad_price_config_is_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        PriceTable.from_config(config)


def test_impossible_usage_is_refused():
    price = ModelPrice(1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="exceeds prompt_tokens"):
        cost_usd(price, 10, 11, 0)
    with pytest.raises(ValueError, match=">= 0"):
        cost_usd(price, 10, 0, -1)
