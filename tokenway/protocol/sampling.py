"""What a generation asks of the engine, as values every layer may hold: SamplingParams (how to
pick tokens and when to stop) and StructuredOutputSpec (what the output must match).

Both are frozen and checked once, at construction, raising FieldError (a ValueError naming the
request field at fault). No torch, no grammar engine: routing, safety and the server build and
pass these without loading the model's stack (frontend/structured_output.py compiles a spec).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NoReturn

from tokenway.protocol.errors import FieldError

KINDS = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """What the output must match. Hashable, so compiled grammars are cached by spec.

    json_object: any JSON object. json_schema: `schema`, a JSON schema object (a dict or its
    JSON text; kept as compact JSON text, key order preserved because properties are
    generated in schema order). regex: `pattern`, matched in full. grammar: `grammar`, a
    Lark grammar in llguidance's dialect (it may embed JSON schemas with %json).
    """

    kind: str
    schema: str | None = None
    pattern: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            _fail(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        needed = {"json_object": None, "json_schema": "schema", "regex": "pattern", "grammar": "grammar"}[self.kind]
        for name in ("schema", "pattern", "grammar"):
            if name != needed and getattr(self, name) is not None:
                _fail(f"{name} is not used by kind {self.kind!r}")
        if self.kind == "json_schema":
            object.__setattr__(self, "schema", _schema_text(self.schema))
        elif needed is not None:
            value = getattr(self, needed)
            if not isinstance(value, str) or not value:
                _fail(f"kind {self.kind!r} needs a non-empty string {needed}")

    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> StructuredOutputSpec:
        return cls("json_schema", schema=_schema_text(schema))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        return cls("regex", pattern=pattern)


def _fail(message: str) -> NoReturn:
    raise FieldError("response_format", message)


def _schema_text(schema: object) -> str:
    """A JSON schema object (a dict or its JSON text) as compact JSON text, its key order kept."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            _fail(f"schema is not valid JSON ({exc})")
    if not isinstance(schema, Mapping):
        _fail(f"schema must be a JSON object, got {type(schema).__name__}")
    try:
        return json.dumps(dict(schema), separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        _fail(f"schema is not JSON-serializable ({exc})")


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    """How many tokens a reasoning model's thinking part may take. The engine counts the tokens
    between the part's opening and closing sequences; when max_tokens are spent and the part is
    still open, it writes end_token_ids itself (the model's own closing tag), so the reply goes
    on to its answer. Token ids, not text: the engine never detokenizes.

    start_token_ids open the part in the output (Qwen3 writes `<think>` first); starts_open says
    the prompt opened it already (a template whose generation prompt ends in `<think>`)."""

    max_tokens: int
    end_token_ids: tuple[int, ...]
    start_token_ids: tuple[int, ...] = ()
    starts_open: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            _fail_field("reasoning_budget", f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        object.__setattr__(self, "end_token_ids", tuple(int(t) for t in self.end_token_ids))
        object.__setattr__(self, "start_token_ids", tuple(int(t) for t in self.start_token_ids))
        if not self.end_token_ids:
            _fail_field("reasoning_budget", "end_token_ids must not be empty")
        if not self.starts_open and not self.start_token_ids:
            _fail_field("reasoning_budget", "needs start_token_ids unless the prompt opens the part (starts_open)")


@dataclass(frozen=True, slots=True)
class ThinkingRequest:
    """What a call asks of a reasoning model's thinking, whatever API it came through (chat's
    reasoning_effort and chat_template_kwargs, Responses' reasoning.effort, Anthropic's
    thinking). The local model's frontend turns it into its template's switch and a
    ReasoningBudget; an upstream replica into its API's own field."""

    enabled: bool | None = None  # None: the model's default (what its template does unasked)
    budget_tokens: int | None = None  # None: unbounded (max_tokens still bounds the whole reply)

    def __post_init__(self) -> None:
        if self.budget_tokens is not None and (not isinstance(self.budget_tokens, int) or self.budget_tokens < 0):
            _fail_field("budget_tokens", f"must be an integer >= 0, got {self.budget_tokens!r}")


# OpenAI's reasoning effort levels as thinking budgets, LiteLLM's mapping onto Anthropic's
# budget_tokens (so one effort costs the same tokens whichever way a call reaches a model);
# "none" turns thinking off where the model's template can.
EFFORT_BUDGETS: Mapping[str, int] = MappingProxyType({
    "none": 0, "minimal": 128, "low": 1024, "medium": 2048, "high": 4096, "xhigh": 8192,
})


def effort_thinking(effort: str | None) -> ThinkingRequest | None:
    """The ThinkingRequest an OpenAI reasoning effort names; None for no effort (the model's
    default). An unknown level raises FieldError("reasoning_effort")."""
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        _fail_field("reasoning_effort", f"must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}")
    if effort == "none":
        return ThinkingRequest(enabled=False)
    return ThinkingRequest(enabled=True, budget_tokens=EFFORT_BUDGETS[effort])


def _fail_field(field_name: str, message: str) -> NoReturn:
    raise FieldError(field_name, message)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Checked once, at construction."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None
    presence_penalty: float = 0.0  # in [-2, 2], OpenAI semantics
    frequency_penalty: float = 0.0  # in [-2, 2], OpenAI semantics
    repetition_penalty: float = 1.0  # > 0, CTRL / HF semantics; 1 disables
    logit_bias: Mapping[int, float] | None = None  # token id -> bias in [-100, 100]
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token plus k alternatives
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None  # constrain the output to a schema, regex or grammar
    reasoning_budget: ReasoningBudget | None = None  # a reasoning model's thinking, ended by the engine when spent

    def __post_init__(self) -> None:
        def fail(field_name: str, message: str) -> NoReturn:
            raise FieldError(field_name, message)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            fail("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value!r}")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            fail("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            fail("structured_output", f"must be a StructuredOutputSpec, got {type(self.structured_output).__name__}")
        if self.reasoning_budget is not None and not isinstance(self.reasoning_budget, ReasoningBudget):
            fail("reasoning_budget", f"must be a ReasoningBudget, got {type(self.reasoning_budget).__name__}")
        # Normalise the containers so the object is truly immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            fail("stop", "every stop sequence must be a non-empty string")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        if self.logit_bias is not None:
            bias = {}
            for token_id, value in dict(self.logit_bias).items():
                if not -100.0 <= float(value) <= 100.0:
                    fail("logit_bias", f"bias for token {token_id} must be in [-100, 100], got {value!r}")
                bias[int(token_id)] = float(value)
            object.__setattr__(self, "logit_bias", MappingProxyType(bias) if bias else None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n independent choices as n engine requests; with a seed, choice i uses seed + i, so
    the choices differ yet each repeats."""
    if n == 1:
        return [params]
    return [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]
