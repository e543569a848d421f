"""One HTTP call's facts, each made once by the stage that knows it and handed on frozen:

    GatewayMiddleware ─► CallStart    who calls, which endpoint, when (stage 1)
    routing           ─► RouteChoice  the model served and its pool
    Router            ─► ReplicaChoice the replica that ran it, and why (routing/router.py)
    API adaptor       ─► GenerationJob the typed work (protocol/job.py; EmbeddingsJob for embeddings)
    safety stage      ─► InputScreening what the input check found and did (safety/screen.py)
    Gatekeeper.admit  ─► Admission    the limits' reservation and rate headers
    GatewayMiddleware ─► Answer       the status and Retry-After the response's head sent
    whoever sees the call end ─► CallOutcome   status, usage, finish, error
                                   │
                                   ├─► UsageRecord (the ledger row, Gatekeeper)
                                   └─► Trace (Observer)

`Call` only carries them: each slot is written once (a second write is a bug, and raises),
nothing in it is mutated afterwards, and the ledger row and the trace are both derived from
the same outcome, never written piecemeal.

Billing follows generation: a call refused (401, 403, 429, any 4xx) or failed before its
replica produced anything bills no tokens, whoever reports its outcome; its row keeps the
status and the reason. A call that generated and then failed (a 5xx mid-stream), or whose
client left (499), bills what its outcome counts.

A batch line's attempt refused for now (Call.deferred: a 429 or 503 with a Retry-After, before
any replica ran it) is no outcome: the runner runs the line again, under the same ids, and only
the attempt the line ends with writes its ledger row and its trace. An attempt a replica ran is
always one a line ends with, so each is billed once.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenway.gateway.auth import ANONYMOUS, Principal
from tokenway.ids import random_hex
from tokenway.safety.guard import GuardVerdict
from tokenway.safety.screen import InputScreening
from tokenway.stages import StageClock

if TYPE_CHECKING:
    from tokenway.gateway.gatekeeper import Admission
    from tokenway.protocol.job import EmbeddingsJob, GenerationJob
    from tokenway.routing.router import ReplicaChoice

# What a batch line outlives when nothing ran it yet and its answer names a wait (429: the key's
# limits, its batch share, or budget held by calls in flight; 503: no capacity now): the runner
# runs it again after that wait (batches/runner.py). A 429 naming none (a budget used up) is final.
DEFERRED_STATUSES = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class CallStart:
    endpoint: str
    principal: Principal = ANONYMOUS
    request_id: str = ""  # provisional; a generation's job names the call's own id
    started_at: float = 0.0  # unix seconds
    traceparent: str | None = None  # the caller's W3C trace context, when it sent one
    # The Batch API line this call runs (alphanumeric, made by tokenway/batches/): it runs as
    # service class "batch", and its job's id is derived from it, so a line run again after a
    # crash writes no second ledger row. None for a call from the network.
    batch_line: str | None = None

    @classmethod
    def now(cls, endpoint: str, principal: Principal = ANONYMOUS, traceparent: str | None = None) -> CallStart:
        return cls(endpoint, principal, f"req_{random_hex()}", time.time(), traceparent)

    def new_id(self, prefix: str) -> str:
        """An id for what this call makes (its job, its response): random, or for a batch line
        its line's, so that the same line always makes the same id."""
        return f"{prefix}{self.batch_line or random_hex()}"


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """The model a call asked for, by its served name (an alias resolved), and its pool. The
    replica that ran it (a fallback's, after retries) is the router's ReplicaChoice."""

    model: str
    pool: str


@dataclass(frozen=True, slots=True)
class Answer:
    """What the response's head told the caller: its status, and how long its Retry-After
    asked it to wait (seconds; None: it sent none)."""

    status: int
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class CallOutcome:
    status: int  # what the caller got: the HTTP status, or 499 when it left first
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those a reasoning model spent thinking
    max_choice_tokens: int = 0  # the longest choice's completion tokens (TPOT is per choice)
    finish_reason: str | None = None
    error: str | None = None
    cache_reason: str | None = None  # why the prefix cache stopped where it did
    limit_kind: str | None = None  # the limit that refused the call with a 429
    # A JSON reply (response_format json_schema / json_object): whether every choice's text is
    # a whole JSON document. None: no JSON was asked for, or the call failed.
    json_complete: bool | None = None
    # The safety stage's output check: the categories found in the reply, what was done
    # (flag, redact, block; None: nothing found) and its time over the whole reply.
    safety_output: tuple[str, ...] = ()
    safety_output_action: str | None = None
    safety_output_ms: float = 0.0
    # The response cache (gateway/response_cache.py) on a call it may answer: "hit" (replayed,
    # priced at cached_response) or "miss". None: a call it does not cover.
    response_cache: str | None = None

    def unbilled(self) -> CallOutcome:
        """The same outcome with no tokens: a call that generated nothing."""
        return dataclasses.replace(self, prompt_tokens=0, cached_tokens=0, completion_tokens=0, reasoning_tokens=0,
                                   max_choice_tokens=0)


class Call:
    __slots__ = ("clock", "start", "route", "job", "admission", "replica", "outcome", "committed", "screening",
                 "guard", "handed_over", "answer")

    def __init__(self, start: CallStart, clock: StageClock | None = None) -> None:
        self.clock = clock or StageClock()
        self.start = start
        self.route: RouteChoice | None = None
        self.job: GenerationJob | EmbeddingsJob | None = None
        self.admission: Admission | None = None
        self.replica: ReplicaChoice | None = None
        self.outcome: CallOutcome | None = None
        self.committed = False  # the ledger row is written (Gatekeeper's flag)
        self.screening: InputScreening | None = None  # the safety stage's input check
        self.guard: GuardVerdict | None = None  # a guard model's verdict on the input, where one is set
        self.handed_over = False  # another call records this one's work (hand_over)
        self.answer: Answer | None = None  # the response's head, once sent

    @property
    def request_id(self) -> str:
        return self.job.request_id if self.job is not None else self.start.request_id

    @property
    def model(self) -> str:
        return self.route.model if self.route is not None else ""

    def hand_over(self) -> None:
        """Another call now owns this one's work and records it (a background response's run,
        detached from the request that made it): this call writes no ledger row and no trace."""
        self.committed = True
        self.handed_over = True

    def set_route(self, route: RouteChoice) -> None:
        assert self.route is None, "the route is chosen once"
        self.route = route

    def set_job(self, job: GenerationJob | EmbeddingsJob) -> None:
        assert self.job is None, "the job is built once"
        self.job = job

    def set_admission(self, admission: Admission) -> None:
        assert self.admission is None, "a call is admitted once"
        self.admission = admission

    def set_screening(self, screening: InputScreening) -> None:
        assert self.screening is None, "the input is screened once"
        self.screening = screening

    def set_guard(self, verdict: GuardVerdict) -> None:
        assert self.guard is None, "the guard is asked once"
        self.guard = verdict

    def set_answer(self, answer: Answer) -> None:
        assert self.answer is None, "a call's response starts once"
        self.answer = answer

    def set_replica(self, choice: ReplicaChoice) -> None:
        assert self.replica is None, "a call runs on one replica"
        self.replica = choice

    def end(self, outcome: CallOutcome) -> None:
        """The call's one outcome; a later report (the middleware's fallback) is ignored."""
        if self.outcome is None:
            self.outcome = outcome if self._generated(outcome) else outcome.unbilled()

    @property
    def deferred(self) -> bool:
        """A batch line's attempt refused for now, before any replica ran it, and told when to
        retry (DEFERRED_STATUSES): not the line's outcome (the line runs again, under the same
        ids), so it writes no ledger row and no trace. An attempt a replica started is the
        line's outcome, whatever its status: its row bills what it generated, and the line is
        not run again."""
        answer = self.answer
        return (self.start.batch_line is not None and answer is not None and answer.status in DEFERRED_STATUSES
                and answer.retry_after_s is not None and not self._started())

    def _started(self) -> bool:
        """Whether a replica began the work (the router names it at the first event; "" when
        none could run it)."""
        return self.replica is not None and bool(self.replica.replica)

    def _generated(self, outcome: CallOutcome) -> bool:
        """Whether the outcome's tokens are owed: it succeeded, its client left, or its replica
        had started."""
        return outcome.status < 400 or outcome.status == 499 or self._started()

    def end_as_sent(self, status: int) -> None:
        """An outcome for a call that ended without one of its own: the status sent, or 499
        (the client left) if nothing was."""
        self.end(CallOutcome(status or 499, error=None if status else "client disconnected"))

    def end_with_error(self, status: int, error: str, limit_kind: str | None = None) -> None:
        """An outcome for a call that failed before any output (refused, or the client gone
        while its body was read): nothing generated, nothing billed."""
        self.end(CallOutcome(status, error=error, limit_kind=limit_kind))
