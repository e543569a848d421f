"""What a request cost: per-model prices in USD per million tokens, from the config.

    config {"prices": {model: {"input", "cached_input", "output"}}} -> PriceTable
    PriceTable.price(model) + usage (prompt, cached, completion tokens) -> cost_usd
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

_TOKENS_PER_UNIT = 1_000_000
_PRICE_FIELDS = ("input", "cached_input", "output")


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million tokens. cached_input prices the prompt tokens served from the prefix cache."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def __post_init__(self) -> None:
        for name in _PRICE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"price {name}: must be a finite number >= 0 (USD per million tokens), got {value!r}")

    def to_dict(self) -> dict[str, float]:
        """As /v1/models shows it: USD per million tokens."""
        return {"input": self.input, "cached_input": self.cached_input, "output": self.output}


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


class PriceTable:
    """Model name -> ModelPrice. A model without a price costs nothing (self-hosted default)."""

    def __init__(self, model_to_price: Mapping[str, ModelPrice] | None = None) -> None:
        self._model_to_price = dict(model_to_price or {})

    @classmethod
    def from_config(cls, config: Mapping[str, Mapping[str, float]] | None) -> PriceTable:
        """{"model": {"input": 0.15, "cached_input": 0.075, "output": 0.6}}; missing fields are 0."""
        model_to_price = {}
        for model, fields in (config or {}).items():
            if not isinstance(fields, Mapping):
                raise ValueError(f"prices.{model}: expected a mapping of {', '.join(_PRICE_FIELDS)}")
            unknown = set(fields) - set(_PRICE_FIELDS)
            if unknown:
                raise ValueError(f"prices.{model}: unknown field(s) {sorted(unknown)}; use {', '.join(_PRICE_FIELDS)}")
            model_to_price[model] = ModelPrice(**fields)
        return cls(model_to_price)

    def price(self, model: str) -> ModelPrice:
        return self._model_to_price.get(model, ModelPrice())

    def cost_usd(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        return cost_usd(self.price(model), prompt_tokens, cached_tokens, completion_tokens)

    def __contains__(self, model: str) -> bool:
        return model in self._model_to_price
