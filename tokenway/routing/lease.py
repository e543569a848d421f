"""What the balancer hands a caller: the Choice it made and the Lease on the chosen replica.

    Balancer.pick ─► Choice ─► Balancer.acquire ─► Lease ─► record_success / record_failure
                                                         ─► release (the load and slot come back)

A Lease is the only way a call's load leaves the balancer's books and the only path by which
its outcome reaches the replica's breaker, so a caller cannot forget one half of the pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Self

from tokenway.routing.health import ReplicaHealth

Reason = Literal["affinity", "least_loaded", "round_robin", "retry"]


@dataclass(frozen=True, slots=True)
class Choice:
    name: str  # the replica's
    reason: Reason  # "retry" whenever the caller excluded replicas it had tried
    num_matched_tokens: int  # the prompt's leading tokens found in the chosen replica's index
    num_tokens: int  # prompt + max_tokens: the load this call adds while it runs
    block_hashes: tuple[int, ...] = field(default=(), repr=False)  # the prompt's; indexed on acquire


class Lease:
    """One call's slot on one replica. Record the call's outcome (at most once: the first
    counts) before releasing; release() is idempotent, and leaving a `with lease:` releases."""

    __slots__ = ("_has_outcome", "_health", "_is_probe", "_on_release", "_released", "choice")

    def __init__(self, choice: Choice, health: ReplicaHealth | None, is_probe: bool,
                 on_release: Callable[[Lease], None]) -> None:
        self.choice = choice
        self._health = health
        self._is_probe = is_probe  # this call is its replica's half-open probe
        self._on_release = on_release
        self._has_outcome = False
        self._released = False

    @property
    def name(self) -> str:
        return self.choice.name

    @property
    def released(self) -> bool:
        return self._released

    def record_success(self) -> None:
        self._record(True)

    def record_failure(self) -> None:
        """The replica failed the call (connection error, 5xx, timeout); not a client's 4xx or
        a client that went away, which say nothing about the replica."""
        self._record(False)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        health = self._health
        if self._is_probe and not self._has_outcome and health is not None and health.breaker.probe_in_flight:
            health.breaker.abandon_probe()  # no verdict: let the next call probe instead
        self._on_release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _record(self, ok: bool) -> None:
        if self._has_outcome:
            return
        self._has_outcome = True
        if self._health is None:
            return
        if ok:
            self._health.record_success()
        else:
            self._health.record_failure()
