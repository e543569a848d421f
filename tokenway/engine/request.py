"""The engine's request types.

SamplingParams is immutable and owned by nobody. Request is created by the engine core
when a prompt arrives and from then on mutated only by the Scheduler (status,
num_computed_tokens, output tokens); the KV cache manager owns its block table.

Progress is a counter, never a phase flag: tokens [0, num_computed_tokens) have their
KV in the cache, tokens [num_computed_tokens, num_tokens) still have to run. A fresh
prompt, a chunked prefill, a prefix-cache hit and a preempted request that restarts are
all just different values of that counter.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from tokenway.engine.structured_output import GrammarMatcher, StructuredOutputSpec


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

    def __post_init__(self) -> None:
        def fail(field_name: str, message: str) -> None:
            raise ValueError(f"{field_name}: {message}")

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


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context window
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one sampled token under the model, with its top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # All known tokens: the prompt, then every sampled token.
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache on first scheduling; None until then.
    num_cached_tokens: int | None = None
    # Why the prefix cache stopped there (kv_cache/manager.py CACHE_*), from the same lookup.
    cache_reason: str | None = None
    # Hashes of the full blocks of all_token_ids, filled in by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # time.monotonic() when the scheduler first gave it tokens to compute (queue time ends).
    first_scheduled_time: float | None = None
    # Where the output is in its structured-output grammar; set by the engine core when the
    # request is added, advanced by the scheduler per sampled token, dropped when it finishes.
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.sampling_params.greedy:
            # One generator per request: its draws depend on nothing else in the batch.
            seed = self.sampling_params.seed
            if seed is None:
                seed = random.SystemRandom().getrandbits(63)
            self.generator = torch.Generator().manual_seed(seed % (2**64))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
