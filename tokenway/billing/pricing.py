"""What a request cost: per-model prices in USD per million tokens, from the config, per service tier.

    config {"prices": {model: {"input", "cached_input", "output", "cached_response", "flex": {...}, ...}}}
        -> PriceTable
    PriceTable.price(model, service_tier) + usage (prompt, cached, completion tokens) -> cost_usd
    ... a call the response cache answered (gateway/response_cache.py) -> response_cache_cost_usd

A model's own price is its "default" tier's. Another tier (priority, flex, batch) costs its own
price where the model's sets one, else the default price times the tier's multiplier
(DEFAULT_TIER_MULTIPLIERS unless the config sets them: work that can wait at half price).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

_TOKENS_PER_UNIT = 1_000_000
_PRICE_FIELDS = ("input", "cached_input", "output", "cached_response")
PRICED_TIERS = ("priority", "flex", "batch")  # the tiers beside "default", which is the model's own price
DEFAULT_TIER_MULTIPLIERS: Mapping[str, float] = MappingProxyType({"priority": 1.0, "flex": 0.5, "batch": 0.5})


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million tokens. cached_input prices the prompt tokens served from the prefix cache;
    cached_response every token (prompt and completion) of a call the response cache answered.
    tiers: a service tier's own price, where the config gives it one (priced by multiplier else)."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0
    cached_response: float = 0.0
    tiers: Mapping[str, ModelPrice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _PRICE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"price {name}: must be a finite number >= 0 (USD per million tokens), got {value!r}")
        for tier, price in self.tiers.items():
            if tier not in PRICED_TIERS or not isinstance(price, ModelPrice) or price.tiers:
                raise ValueError(f"price {tier}: a tier's price is one of {', '.join(PRICED_TIERS)}, with "
                                 f"{', '.join(_PRICE_FIELDS)} (the model's own price is the default tier's)")
        object.__setattr__(self, "tiers", dict(self.tiers))  # the caller's mapping is not shared

    def __hash__(self) -> int:
        return hash((self.input, self.cached_input, self.output, self.cached_response,
                     tuple(sorted(self.tiers.items()))))

    def scaled(self, factor: float) -> ModelPrice:
        return ModelPrice(self.input * factor, self.cached_input * factor, self.output * factor,
                          self.cached_response * factor)

    def to_dict(self) -> dict[str, float]:
        """As /v1/models shows it: USD per million tokens (the default tier's)."""
        return {"input": self.input, "cached_input": self.cached_input, "output": self.output,
                "cached_response": self.cached_response}


def cost_usd(price: ModelPrice, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """Cached prompt tokens at cached_input, the rest of the prompt at input, completion at output.
    cached_tokens is part of prompt_tokens (OpenAI's prompt_tokens_details.cached_tokens)."""
    if min(prompt_tokens, cached_tokens, completion_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")
    micro_usd = ((prompt_tokens - cached_tokens) * price.input + cached_tokens * price.cached_input
                 + completion_tokens * price.output)
    return micro_usd / _TOKENS_PER_UNIT


def response_cache_cost_usd(price: ModelPrice, prompt_tokens: int, completion_tokens: int) -> float:
    """A call the response cache answered: every token it replayed at cached_response (0 unless set)."""
    return (prompt_tokens + completion_tokens) * price.cached_response / _TOKENS_PER_UNIT


def model_price(name: str, fields: object) -> ModelPrice:
    """One model's price from the config: {"input", "cached_input", "output"} (missing ones are
    0), and a table of the same for each tier priced apart ({"flex": {...}})."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"prices.{name}: expected a mapping of {', '.join(_PRICE_FIELDS)}")
    unknown = set(fields) - set(_PRICE_FIELDS) - set(PRICED_TIERS)
    if unknown:
        raise ValueError(f"prices.{name}: unknown field(s) {sorted(unknown)}; use {', '.join(_PRICE_FIELDS)}, "
                         f"or a table for a tier ({', '.join(PRICED_TIERS)})")
    tiers = {}
    for tier in PRICED_TIERS:
        if tier in fields:
            tier_fields = fields[tier]
            if not isinstance(tier_fields, Mapping) or set(tier_fields) - set(_PRICE_FIELDS):
                raise ValueError(f"prices.{name}.{tier}: expected a mapping of {', '.join(_PRICE_FIELDS)}")
            tiers[tier] = ModelPrice(**tier_fields)
    return ModelPrice(**{key: value for key, value in fields.items() if key in _PRICE_FIELDS}, tiers=tiers)


def tier_multipliers(config: Mapping[str, float] | None) -> Mapping[str, float]:
    """DEFAULT_TIER_MULTIPLIERS with the config's {tier: factor} over them."""
    multipliers = dict(DEFAULT_TIER_MULTIPLIERS)
    for tier, factor in (config or {}).items():
        if tier not in PRICED_TIERS:
            raise ValueError(f"tier_price_multipliers.{tier}: not a tier priced apart; use {', '.join(PRICED_TIERS)}")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"tier_price_multipliers.{tier}: must be a finite number >= 0, got {factor!r}")
        multipliers[tier] = float(factor)
    return multipliers


FREE = ModelPrice()  # a model without a price (made once: every call of an unpriced model asks)


class PriceTable:
    """Model name -> ModelPrice, and the multipliers that price a tier from the default price.
    A model without a price costs nothing (self-hosted default), at every tier."""

    def __init__(self, model_to_price: Mapping[str, ModelPrice] | None = None,
                 multipliers: Mapping[str, float] | None = None) -> None:
        self._model_to_price = dict(model_to_price or {})
        self.multipliers = tier_multipliers(multipliers)

    @classmethod
    def from_config(cls, config: Mapping[str, object] | None,
                    multipliers: Mapping[str, float] | None = None) -> PriceTable:
        """{"model": {"input": 0.15, "cached_input": 0.075, "output": 0.6, "priority": {...}}};
        missing fields are 0."""
        return cls({model: model_price(model, fields) for model, fields in (config or {}).items()}, multipliers)

    def price(self, model: str, service_tier: str = "default") -> ModelPrice:
        """The model's price at a tier: its own for "default" (with its tiers' prices within)."""
        price = self._model_to_price.get(model, FREE)
        if service_tier == "default":
            return price
        own = price.tiers.get(service_tier)
        return own if own is not None else price.scaled(self.multipliers[service_tier])

    def cost_usd(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                 service_tier: str = "default") -> float:
        return cost_usd(self.price(model, service_tier), prompt_tokens, cached_tokens, completion_tokens)

    def __contains__(self, model: str) -> bool:
        return model in self._model_to_price
