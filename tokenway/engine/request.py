"""The engine's request: what the scheduler moves through its queues.

Its SamplingParams (protocol/sampling.py) is immutable and owned by nobody. Request is
created by the engine core when a prompt arrives and from then on mutated only by the Scheduler
(status, num_computed_tokens, output tokens); the KV cache manager owns its block table.

Progress is a counter, never a phase flag: tokens [0, num_computed_tokens) have their
KV in the cache, tokens [num_computed_tokens, num_tokens) still have to run. A fresh
prompt, a chunked prefill, a prefix-cache hit and a preempted request that restarts are
all just different values of that counter.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenway.engine.thinking import ThinkingState
from tokenway.frontend.structured_output import GrammarMatcher
from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass, class_rank
from tokenway.protocol.sampling import SamplingParams


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
    # Always the grammar that constrains the next token: with a reasoning budget it waits in
    # `thinking` until the thinking part closes.
    grammar: GrammarMatcher | None = None
    # Where the output is in a reasoning model's thinking part (engine/thinking.py); None
    # without a reasoning budget.
    thinking: ThinkingState | None = None
    # How urgently it runs (protocol/job.py): the scheduler admits, and gives its token budget to,
    # a better class first, and preempts the worst class first. class_rank is its sort key.
    service_class: ServiceClass = "default"
    class_rank: int = field(init=False)

    def __post_init__(self) -> None:
        if self.service_class not in SERVICE_CLASSES:
            raise ValueError(f"service_class: expected one of {', '.join(SERVICE_CLASSES)}, "
                             f"got {self.service_class!r}")
        self.class_rank = class_rank(self.service_class)
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.sampling_params.greedy:
            # One generator per request: its draws depend on nothing else in the batch.
            seed = self.sampling_params.seed
            if seed is None:
                seed = random.SystemRandom().getrandbits(63)
            self.generator = torch.Generator().manual_seed(seed % (2**64))
        budget = self.sampling_params.reasoning_budget
        if budget is not None and self.thinking is None:
            self.thinking = ThinkingState.start(budget, self.grammar)
            self.grammar = None

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
