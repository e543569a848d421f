"""One request's bill, as the ledger stores it: a UsageRecord per request_id, in COLUMNS order."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenway.json_codec import dumps_ascii

# Columns added since the first schema come last, as each migration appends them (and rows
# journaled before them read back with their defaults).
COLUMNS = ("request_id", "key_id", "model", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd",
           "finish_reason", "error", "status", "stages_ms", "started_at", "finished_at", "trace", "reasoning_tokens",
           "service_tier")
JSON_COLUMNS = ("stages_ms", "trace")


@dataclass(slots=True)
class UsageRecord:
    """One request's bill. cached_tokens is part of prompt_tokens, reasoning_tokens (a reasoning
    model's thinking) of completion_tokens; timestamps are unix seconds."""

    request_id: str
    key_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    finish_reason: str | None
    error: str | None
    status: int
    stages_ms: dict[str, float]
    started_at: float
    finished_at: float
    # The rest of the request's trace (observability/traces.py) as of the commit: endpoint,
    # ttft_ms, tpot_ms, total_ms, cache_reason... so `tokenway trace` outlives the ring.
    trace: dict = field(default_factory=dict)
    reasoning_tokens: int = 0
    service_tier: str = "default"  # the tier the call ran at (gateway/tiers.py), which priced it
    # The JSON columns (stages_ms, trace) as JSON text, compact and ASCII, made once with the
    # row: its journal line and its SQLite row both use them. Not a column.
    encoded_json: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Whatever text a client managed to put in (a lone surrogate in an echoed model name, a
        # NUL), the row must stay writable to every backend.
        self.request_id, self.key_id, self.model = (storable_text(self.request_id), storable_text(self.key_id),
                                                    storable_text(self.model))
        if self.finish_reason is not None:
            self.finish_reason = storable_text(self.finish_reason)
        if self.error is not None:
            self.error = storable_text(self.error)
        self.trace, trace_json = storable_json(self.trace)
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens, self.reasoning_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        # NaN or inf would make the row unreadable JSON (and a budget that never trips).
        if not math.isfinite(self.cost_usd) or self.cost_usd < 0:
            raise ValueError(f"cost_usd must be finite and >= 0, got {self.cost_usd}")
        if not all(math.isfinite(ms) for ms in self.stages_ms.values()):
            raise ValueError("stages_ms values must be finite")
        self.encoded_json = (dumps_ascii(self.stages_ms), trace_json or dumps_ascii(self.trace))

    def to_row(self, encode_json: Callable[[dict], Any] | None = None) -> tuple:
        """Values in COLUMNS order, the JSON columns encoded for the backend (None: as the JSON
        text they were encoded to once)."""
        if encode_json is None:
            encoded = dict(zip(JSON_COLUMNS, self.encoded_json))
            return tuple(encoded[name] if name in JSON_COLUMNS else getattr(self, name) for name in COLUMNS)
        return tuple(encode_json(getattr(self, name)) if name in JSON_COLUMNS else getattr(self, name)
                     for name in COLUMNS)

    @classmethod
    def from_row(cls, row: Sequence, decode_json: Callable[[Any], dict] = json.loads) -> UsageRecord:
        values: list[Any] = [decode_json(value) if name in JSON_COLUMNS else value
                             for name, value in zip(COLUMNS, row)]
        return cls(*values)


def storable_text(text: str) -> str:
    """`text` with what no backend can store made visible instead: a lone surrogate (not
    encodable as UTF-8) becomes its escape `\\ud800`, a NUL (refused by PostgreSQL text and
    jsonb) becomes `\\x00`."""
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00") if "\x00" in text else text


def storable_json(value: Any) -> tuple[Any, str | None]:
    """storable_text applied to every string (keys included) of a JSON-like value: the value
    itself where its JSON has no \\u escape (every string ASCII, with no NUL), as nearly every
    call's trace (one C-encoded pass instead of a call per field); and that compact JSON text,
    where it was made on the way (None where not)."""
    try:
        text = dumps_ascii(value)
        if "\\u" not in text:
            return value, text
    except (TypeError, ValueError):
        pass  # not JSON-encodable as it is: the walk keeps what it can
    return _storable(value), None


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_storable(v) for v in value]
    return value
