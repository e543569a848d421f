"""The tokenway worker protocol: JSON over HTTP under /worker/v1, spoken by a worker
(server/worker_api.py, `tokenway worker`) and a gateway's client for it (routing/worker_replica.py).
A gateway templates, parses tools and bills; a worker only runs token ids.

    POST /worker/v1/generate   {"request_id", "prompt_token_ids": [...], "params": {...}, "n", "service_class"}
        service_class: "priority" | "default" | "flex" | "batch", how urgently the worker's engine
        schedules the call; absent means "default" (a gateway sends it only for another class,
        so a worker older than service classes still takes default calls)
        params: every SamplingParams field but n (params_to_dict); structured_output is
        {"kind", "schema", "pattern", "grammar"} or null; reasoning_budget is {"max_tokens",
        "end_token_ids", "start_token_ids", "starts_open"} or null; logit_bias keys are token ids as text
      200 text/event-stream, one `data:` line an event:
        {"index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason",      a choice's delta, as released
         "num_cached_tokens", "cache_reason"}
            logprobs: null or one [token_id, logprob, rank, [[token_id, logprob], ...]] per new token
            finish_reason: "stop" | "length" on the choice's last delta, else null
            num_cached_tokens, cache_reason: the choice's prompt tokens found in the prefix cache
              and why it stopped there (kv_cache/manager.py CACHE_*), known from its first delta
        {"usage": {"prompt_tokens", "completion_tokens", "cached_tokens", "cache_reason"}}
            once every choice finished: the prompt counted once, completion_tokens over all
            choices, cached_tokens (and its reason) the most any choice found in the cache
        [DONE]
      or, when the call fails after the stream began: {"error": {"message", "type", "code": <HTTP status>}}
      and the end of the body (503: nothing of the call ran, retry elsewhere; 500: it failed part way)
      400 bad body, params or prompt · 401 no or wrong secret · 503 + Retry-After engine down or full
    GET /worker/v1/state       model, window, vocabulary, block size, load and prefix-cache counters
    GET /worker/v1/tokenizer   {"model", "files": {file name: text}}: TOKENIZER_FILES the model has
    GET /health, GET /ready    no secret needed: liveness, and whether the engine takes calls

Every /worker/v1 route needs `Authorization: Bearer <secret>`. The n choices of a call run as
n engine requests with choice_params' seeds (seed + i), as `tokenway serve` runs them. An
engine's "abort" is never a finish_reason here: a worker that gives up a request its caller
still reads sends the error event. Floats are JSON numbers, a logprob of minus infinity
Python's `-Infinity`.
"""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import ConfigDict, Field

from tokenway.protocol.errors import FieldError
from tokenway.protocol.job import ServiceClass
from tokenway.protocol.outputs import TokenLogprob
from tokenway.protocol.sampling import ReasoningBudget, SamplingParams, StructuredOutputSpec

PREFIX = "/worker/v1"
MAX_CHOICES = 128
# What Tokenizer.from_dir and the engine's eos / vocabulary checks read from a model directory
# (config.json: ModelConfig, for the eos ids structured output needs); never the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "config.json")


class WireStructuredOutput(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    kind: str
    json_schema: str | None = Field(None, alias="schema")  # compact JSON text, as StructuredOutputSpec keeps it
    pattern: str | None = None
    grammar: str | None = None


class WireReasoningBudget(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: int
    end_token_ids: list[int]
    start_token_ids: list[int] = []
    starts_open: bool = False


class WireParams(pydantic.BaseModel):
    """SamplingParams but n, strictly typed; unknown fields are refused, so a gateway newer than
    its worker gets a 400 instead of a setting silently ignored. SamplingParams checks the ranges."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: WireStructuredOutput | None = None
    reasoning_budget: WireReasoningBudget | None = None


class GenerateBody(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    params: WireParams
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    service_class: ServiceClass = "default"


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """Every field (never a default left for the worker to fill in), JSON-ready."""
    spec, budget = params.structured_output, params.reasoning_budget
    return {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "seed": params.seed, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "repetition_penalty": params.repetition_penalty,
        "logit_bias": None if params.logit_bias is None else {str(t): b for t, b in params.logit_bias.items()},
        "max_tokens": params.max_tokens, "min_tokens": params.min_tokens, "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids), "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos, "logprobs": params.logprobs, "skip_special_tokens": params.skip_special_tokens,
        "structured_output": None if spec is None else {"kind": spec.kind, "schema": spec.schema,
                                                        "pattern": spec.pattern, "grammar": spec.grammar},
        "reasoning_budget": None if budget is None else {
            "max_tokens": budget.max_tokens, "end_token_ids": list(budget.end_token_ids),
            "start_token_ids": list(budget.start_token_ids), "starts_open": budget.starts_open},
    }


def params_from_wire(wire: WireParams) -> SamplingParams:
    """Raises ValueError naming the field ("top_p: must be in (0, 1], ...")."""
    fields = wire.model_dump(exclude={"structured_output", "logit_bias", "reasoning_budget"})
    if wire.logit_bias is not None:
        try:
            fields["logit_bias"] = {int(token_id): bias for token_id, bias in wire.logit_bias.items()}
        except ValueError:
            raise FieldError("logit_bias", "keys must be token ids") from None
    spec = wire.structured_output
    if spec is not None:
        fields["structured_output"] = StructuredOutputSpec(spec.kind, schema=spec.json_schema, pattern=spec.pattern,
                                                           grammar=spec.grammar)
    budget = wire.reasoning_budget
    if budget is not None:
        fields["reasoning_budget"] = ReasoningBudget(budget.max_tokens, tuple(budget.end_token_ids),
                                                     tuple(budget.start_token_ids), budget.starts_open)
    return SamplingParams(n=1, stop=tuple(fields.pop("stop")), stop_token_ids=tuple(fields.pop("stop_token_ids")),
                          **fields)


def logprobs_to_wire(logprobs: list[TokenLogprob] | None) -> list[list[Any]] | None:
    if logprobs is None:
        return None
    return [[entry.token_id, entry.logprob, entry.rank, [[t, lp] for t, lp in entry.top]] for entry in logprobs]


def logprobs_from_wire(entries: list[Any] | None) -> tuple[TokenLogprob, ...] | None:
    """Raises TypeError or ValueError on a malformed entry."""
    if entries is None:
        return None
    return tuple(TokenLogprob(_int(token_id), float(logprob), _int(rank), [(_int(t), float(lp)) for t, lp in top])
                 for token_id, logprob, rank, top in entries)


def _int(value: Any) -> int:
    if type(value) is not int:  # bool is an int to Python, not to this protocol
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value
