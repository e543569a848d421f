"""BatchRunner: one gateway's worker on the shared batch queue, an asyncio task.

    loop:  room under capacity() and max_running ─► store.claim(worker_id, n, lease_s)
               └─► each line, concurrently: execute(line) ─► LineOutcome ─► store.finish(worker_id, line, outcome)
           every lease_s / 3 ─► store.renew(the lines running): a live runner's claims never lapse
           every upkeep_s, and when its last line ends ─► store.expire, finalize_ready, purge_files
    stop(grace_s): claims no more; the lines running finish within the grace, or are cancelled
           and left to their lease (another runner, or this one restarted, runs them again)

A runner that dies (killed, SIGKILL, its task cancelled) stops renewing: its claims lapse after
lease_s and any runner takes them. A line is then run again, which is safe: its calls derive
their ids from the line (BatchLine.line_id), so its ledger row is written once, and only the
runner holding the claim writes its outcome. A line that raises is a failed outcome (500); a
database down is waited out: nothing stops the runner but stop() or its task's cancellation.
A line refused for now (LineOutcome.retry_after: a 429 from the key's limits or budget, a 503
for capacity) is deferred, not finished: claimed again once its wait is over, until its batch
expires, so a batch's limits slow it down rather than fail its lines.

RunnerStats: what the runner counts as it works, and the queue as its last upkeep read it
(store.overview): /metrics and the dashboard read it, never the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tokenway.batches.store import Batch, BatchLine, BatchStore, BatchStoreUnavailable, LineOutcome, QueueOverview
from tokenway.protocol.errors import InternalServerError, anthropic_error_body, openai_error_body, truncate

logger = logging.getLogger(__name__)

Execute = Callable[[BatchLine], Awaitable[LineOutcome]]

DEFAULT_LEASE_S = 60.0
DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_CLAIM = 32  # lines one claim takes: a claim is one transaction, short and small
DEFAULT_POLL_S = 1.0  # how often an idle runner looks for work (or capacity) again
DEFAULT_UPKEEP_S = 5.0
# A deferred line's wait: what its refusal asked for, within these bounds.
MIN_DEFER_S = 1.0
MAX_DEFER_S = 300.0
OVERVIEW_BATCHES = 20  # running batches an overview reads the counts of (the oldest: those running now)


def failed_outcome(line: BatchLine, exc: BaseException) -> LineOutcome:
    """A line whose run raised: a 500, the error's message in the line's API's error body."""
    error = InternalServerError(f"The request failed in the server: {type(exc).__name__}: {truncate(str(exc), 200)}")
    body = anthropic_error_body(error) if line.api == "anthropic" else openai_error_body(error)
    return LineOutcome("failed", error.status, body, None)


@dataclass(slots=True)
class RunnerStats:
    """Written by one runner (its event loop), read by /metrics and the dashboard. The counts are
    this runner's since it started; `overview` is the whole queue's (every gateway's), as of
    `overview_at` (unix time; None before the first upkeep read it)."""

    num_lines_by_outcome: dict[str, int] = field(default_factory=lambda: {"succeeded": 0, "failed": 0})
    num_deferred: int = 0  # lines put back after a 429 or 503, to run again after their wait
    num_running: int = 0
    overview: QueueOverview | None = None
    overview_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        overview = self.overview
        return {
            "num_lines_by_outcome": dict(self.num_lines_by_outcome), "num_deferred": self.num_deferred,
            "num_running": self.num_running, "overview_at": self.overview_at,
            "queue": None if overview is None else {
                "num_batches_by_status": dict(overview.num_batches_by_status),
                "num_lines_pending": overview.num_lines_pending, "num_lines_claimed": overview.num_lines_claimed,
                "running": [batch_progress(batch) for batch in overview.running],
            },
        }


def batch_progress(batch: Batch) -> dict[str, Any]:
    counts = batch.counts
    return {"id": batch.id, "key_id": batch.key_id, "api": batch.api, "endpoint": batch.endpoint,
            "model": batch.model, "status": batch.status, "created_at": batch.created_at,
            "expires_at": batch.expires_at, "total": counts.total, "succeeded": counts.succeeded,
            "failed": counts.failed, "cancelled": counts.cancelled, "expired": counts.expired,
            "pending": counts.pending}


class BatchRunner:
    def __init__(self, store: BatchStore, execute: Execute, worker_id: str, capacity: Callable[[], int],
                 lease_s: float = DEFAULT_LEASE_S, *, max_running: int = DEFAULT_MAX_RUNNING,
                 max_claim: int = DEFAULT_MAX_CLAIM, poll_s: float = DEFAULT_POLL_S,
                 upkeep_s: float = DEFAULT_UPKEEP_S, stats: RunnerStats | None = None,
                 forward: Callable[[], Awaitable[None]] | None = None) -> None:
        """worker_id: unique to this runner's life (a restarted process is another worker: the
        claims of the one before lapse, they are not resumed). capacity: how many lines this runner
        may have running now, its own included (the room interactive work leaves on the engine or
        the replicas, as the caller measures it); it starts the difference. A total, not what is
        free: a line just started is not in the engine's counts yet, and what is free there would
        count its slot again. stats:
        where it counts (made before the runner, for readers made before it). forward: a step of
        the batches upstreams run whole (server/batch_forward.py), taken at every upkeep before
        finalizing: it must not wait on the upstream (it starts that work and returns)."""
        if lease_s <= 0 or max_running < 1 or max_claim < 1 or poll_s <= 0 or upkeep_s <= 0:
            raise ValueError("lease_s, poll_s and upkeep_s must be > 0; max_running and max_claim >= 1")
        self._store = store
        self._execute = execute
        self.worker_id = worker_id
        self._capacity = capacity
        self._lease_s = lease_s
        self._max_running = max_running
        self._max_claim = max_claim
        self._poll_s = poll_s
        self._upkeep_s = upkeep_s
        self._running: dict[asyncio.Task[None], BatchLine] = {}
        self._stopped: set[asyncio.Task[None]] = set()  # lines of a cancelled batch, being stopped
        self._releasing: set[asyncio.Task[None]] = set()  # releasing the claims of stopped lines
        self._wake = asyncio.Event()  # a line ended, a batch was created here, or stop() was called
        self._draining = False
        self._num_ended_since_upkeep = 0
        self._claim_after = 0.0  # time.monotonic(): through an outage, no claims before it
        self._task: asyncio.Task[None] | None = None
        self.stats = stats if stats is not None else RunnerStats()
        self._forward = forward

    @property
    def num_running(self) -> int:
        return len(self._running)

    def start(self) -> asyncio.Task[None]:
        """The runner's task. Cancelling it kills the runner: its lines are cancelled, their
        claims left to lapse."""
        if self._task is not None:
            raise RuntimeError("the batch runner is started already")
        self._task = asyncio.create_task(self._loop(), name=f"batch-runner-{self.worker_id}")
        # A batch created here runs at once, not at the next look (other gateways find it then);
        # one cancelled here stops its lines here at once (others' at their next upkeep).
        self._store.on_created(self._wake.set)
        self._store.on_cancelled(self._stop_lines_of)
        return self._task

    async def stop(self, grace_s: float = 30.0) -> None:
        """Claim no more lines; wait up to grace_s for those running to finish (their claims
        still renewed), then cancel the rest. Idempotent."""
        task = self._task
        if task is None or task.done():
            return
        self._draining = True
        self._wake.set()
        await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            logger.info("batch runner %s: %d lines still running after %.0f s; left to their lease",
                        self.worker_id, len(self._running), grace_s)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        next_renew = next_upkeep = 0.0
        try:
            while not (self._draining and not self._running):
                now = time.monotonic()
                if now >= next_upkeep or (self._num_ended_since_upkeep and not self._running):
                    next_upkeep = now + await self._guarded(self._upkeep, self._upkeep_s)
                if now >= next_renew:
                    next_renew = now + await self._guarded(self._renew, self._lease_s / 3)
                full = False
                if not self._draining and time.monotonic() >= self._claim_after:
                    full = await self._claim()
                if not full:  # nothing more to take now: wait for a line to end, or the next look
                    timeout = max(0.0, min(self._poll_s, next_renew - time.monotonic()))
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    except TimeoutError:
                        pass
                    self._wake.clear()
        finally:
            # Killed (cancelled), or a drain that ended: the lines left are abandoned to their lease.
            for task in (*self._running, *self._releasing):
                task.cancel()
            if self._running or self._releasing:
                await asyncio.gather(*self._running, *self._releasing, return_exceptions=True)

    async def _guarded(self, step: Callable[[], Awaitable[None]], every_s: float) -> float:
        """Run a periodic step; seconds until it is due again (later through an outage)."""
        try:
            await step()
        except BatchStoreUnavailable as exc:
            return max(every_s, exc.retry_after or 0.0)
        except Exception:
            logger.exception("batch runner %s: a store call failed", self.worker_id)
        return every_s

    async def _upkeep(self) -> None:
        self._num_ended_since_upkeep = 0
        now = time.time()
        await self._store.expire(now)
        if self._forward is not None:
            await self._forward()
        await self._store.finalize_ready(now)
        await self._store.purge_files(now)
        self.stats.overview = await self._store.overview(OVERVIEW_BATCHES)
        self.stats.overview_at = time.time()
        for batch in self.stats.overview.running:  # cancelled through another gateway
            if batch.status == "cancelling":
                self._stop_lines_of(batch.id)

    def _stop_lines_of(self, batch_id: str) -> None:
        """Stop this runner's lines of a batch now cancelling, running or waiting in an engine:
        a line stopped writes its ledger row as any call cut off does (its prompt; no output, a
        batch line's reply crossing whole at its end) and ends cancelled, as the lines no runner
        held did."""
        stopping = [(task, line) for task, line in self._running.items()
                    if line.batch_id == batch_id and task not in self._stopped]
        for task, _ in stopping:
            self._stopped.add(task)
            task.cancel()
        if stopping:
            release = asyncio.get_running_loop().create_task(self._release_stopped(stopping))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)

    async def _release_stopped(self, stopping: list[tuple[asyncio.Task[None], BatchLine]]) -> None:
        """Once the stopped lines' tasks have ended, their claims lapse now (a line that ended
        first is done, and its release a no-op): their batch being cancelling, the next finalize
        ends them cancelled, rather than hold the batch in cancelling for the lease."""
        await asyncio.gather(*(task for task, _ in stopping), return_exceptions=True)
        for _, line in stopping:
            with contextlib.suppress(BatchStoreUnavailable):  # else it lapses with its lease
                await self._store.defer(self.worker_id, line, time.time())

    async def _renew(self) -> None:
        lines = list(self._running.values())
        if lines:
            await self._store.renew(self.worker_id, lines, time.time() + self._lease_s)

    async def _claim(self) -> bool:
        """Claim what there is room for, and start running it; whether it took all it asked for
        (then more may be waiting)."""
        try:
            target = min(self._capacity(), self._max_running)
        except Exception:
            logger.exception("batch runner %s: capacity() failed; taken as none", self.worker_id)
            return False
        free = min(target - len(self._running), self._max_claim)
        if free <= 0:
            return False
        try:
            lines = await self._store.claim(self.worker_id, free, self._lease_s, time.time())
        except BatchStoreUnavailable as exc:
            self._claim_after = time.monotonic() + (exc.retry_after or self._poll_s)
            return False
        except Exception:
            logger.exception("batch runner %s: claiming lines failed", self.worker_id)
            return False
        for line in lines:
            task = asyncio.create_task(self._run_line(line), name=f"batch-line-{line.line_id}")
            self._running[task] = line
            task.add_done_callback(self._line_ended)
            self.stats.num_running = len(self._running)
            # One line's start a loop turn: its templating and admission run on the event loop
            # interactive calls share, and 32 started at once held a call arriving then behind
            # all of them (tens of ms); started so, it waits for about one.
            await asyncio.sleep(0)
        return len(lines) == free

    async def _run_line(self, line: BatchLine) -> None:
        try:
            outcome = await self._execute(line)
            if not isinstance(outcome, LineOutcome) or outcome.outcome not in ("succeeded", "failed"):
                raise TypeError(f"execute returned {truncate(repr(outcome))}, not a succeeded or failed LineOutcome")
        except Exception as exc:
            logger.warning("batch runner %s: line %s raised %r", self.worker_id, line.line_id, exc)
            outcome = failed_outcome(line, exc)
        # Through an outage the outcome is tried again while the claim may still be ours; past
        # the lease another runner may hold it, and runs the line again.
        give_up_at = time.monotonic() + self._lease_s
        while True:
            try:
                if outcome.retry_after is not None:
                    wait_s = min(MAX_DEFER_S, max(MIN_DEFER_S, outcome.retry_after))
                    if await self._store.defer(self.worker_id, line, time.time() + wait_s):
                        self.stats.num_deferred += 1
                    return
                if await self._store.finish(self.worker_id, line, outcome):
                    self.stats.num_lines_by_outcome[outcome.outcome] += 1
                else:
                    logger.info("batch runner %s: line %s was no longer ours to finish", self.worker_id,
                                line.line_id)
                return
            except BatchStoreUnavailable as exc:
                wait_s = exc.retry_after or self._poll_s
                if time.monotonic() + wait_s > give_up_at:
                    logger.warning("batch runner %s: line %s's outcome is not stored: the database stayed "
                                   "unreachable; it will run again", self.worker_id, line.line_id)
                    return
                await asyncio.sleep(wait_s)

    def _line_ended(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._stopped.discard(task)
        self.stats.num_running = len(self._running)
        self._num_ended_since_upkeep += 1
        self._wake.set()
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("batch runner %s: a line's task failed: %r", self.worker_id, exc)

