"""Which replica of a pool takes a call, and the pool's bounded queue when all are full.

For a call of T tokens (prompt + max_tokens) whose prompt has the full blocks B:

    C       replicas that are available (health.py), not in `exclude`, below max_in_flight
    L(r)    outstanding tokens on r: the sum of T over r's unreleased leases
    bound   balance_factor * (sum of L(r) over C + T) / |C| + T + balance_slack_tokens
    m(r)    leading blocks of B in r's PrefixIndex (what was routed there recently)

    affinity      r = argmax m(r) over the r in C with L(r) + T <= bound, when
                  m(r) >= 1 and m(r) >= min_match_fraction * |B|   (ties: lower L, then rng)
    least_loaded  otherwise r = argmin L(r) over C                  (ties: rng, else pool order)

That is the default policy, "cache_aware". "least_loaded" skips the affinity step; "round_robin"
takes the next replica of C in turn (the baseline the affinity is measured against).

The bound is that of consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
2016): a replica may carry more than its share, up to balance_factor times the mean counting
this call, so a hot prefix spills to another replica instead of piling onto one; SGLang's
cache-aware router does the same with its balance thresholds. The call's own T on top keeps
affinity alive in an idle pool (where any multiple of a mean near 0 is near 0), and it makes
the bound hold for every placement: even the least loaded replica fits, as
L_min + T <= mean + T <= bound. It scales with the calls, so the bound acts on small ones too:
a fixed slack of thousands of tokens let one replica take every short call of a busy pool
while another stood idle. balance_slack_tokens (default 0) adds a fixed allowance on top,
trading balance for affinity. Whatever the reason, the prompt's
blocks are then recorded in the chosen replica's index. A call with no prompt_token_ids (an
upstream without a tokenizer here) has no blocks and goes least loaded. A non-empty `exclude`
(replicas already tried) makes the reason "retry"; the rule is the same.

A caller's path, one call:

    lease = await balancer.acquire_slot(prompt_token_ids, num_tokens, exclude=tried)
    with lease:                              # release on exit, exactly once, always
        ... replica lease.name runs the call ...
        lease.record_success()  or  lease.record_failure()    # the breaker's passive input
    # failed before the first byte reached the client: tried.add(lease.name) and go again

`pick` is the same decision with no side effect; `route` takes the slot now or raises PoolFull.
Errors (the caller answers 503, or 429 for PoolFull if it prefers, with Retry-After):

    RoutingError              .retry_after (seconds), .code
    ├── NoReplicaAvailable    every replica is down, open, half-open busy or excluded
    └── PoolFull              every available replica is at max_in_flight, and the queue was
                              full (max_queue waiters) or the wait timed out
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from tokenway.routing.health import BreakerState, HealthView, ReplicaHealth
from tokenway.routing.lease import Choice, Lease, Reason
from tokenway.routing.prefix_index import PrefixIndex, prefix_block_hashes

POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True, slots=True)
class BalancerConfig:
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    block_size: int = 16  # tokens per hashed block (the engine's KV block size where known)
    min_match_fraction: float = 0.5  # of the prompt's full blocks, for affinity
    # >= 1. 1.5 keeps 2x round robin's prefix-cache hits on tests/routing's shared-prefix
    # workload (1.25: 1.8x) while no replica takes more than its share of a busy pool.
    balance_factor: float = 1.5
    balance_slack_tokens: int = 0  # on top of the call's own tokens (the module's docstring)
    max_num_indexed_blocks: int = 65536  # per replica; ~100 bytes each
    max_in_flight: int = 64  # per replica, unless the pool names its own
    max_queue: int = 256  # callers waiting for a slot, per pool
    queue_timeout: float = 30.0  # seconds a caller waits for a slot unless it says otherwise
    retry_after: float = 1.0  # seconds, when nothing better is known

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.block_size < 1 or self.max_num_indexed_blocks < 1 or self.max_in_flight < 1:
            raise ValueError("block_size, max_num_indexed_blocks, max_in_flight: must be >= 1")
        if not 0.0 <= self.min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction: must be in [0, 1], got {self.min_match_fraction}")
        if self.balance_factor < 1.0:
            raise ValueError(f"balance_factor: must be >= 1, got {self.balance_factor}")
        if self.balance_slack_tokens < 0 or self.max_queue < 0:
            raise ValueError("balance_slack_tokens, max_queue: must be >= 0")
        if self.queue_timeout < 0 or self.retry_after <= 0:
            raise ValueError("queue_timeout: must be >= 0; retry_after: must be > 0")


class RoutingError(Exception):
    code: ClassVar[str] = "routing_error"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoReplicaAvailable(RoutingError):
    code = "no_replica_available"

    def __init__(self, message: str, *, retry_after: float, name_to_reason: Mapping[str, str]) -> None:
        super().__init__(message, retry_after=retry_after)
        self.name_to_reason = dict(name_to_reason)  # "excluded" or a health.Unavailable value


class PoolFull(RoutingError):
    code = "pool_full"


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as the balancer sees it, for traces, the dashboard and ReplicaStats."""

    name: str
    num_in_flight: int
    max_in_flight: int
    num_outstanding_tokens: int
    num_indexed_blocks: int
    health: HealthView | None


class _Replica:
    __slots__ = ("health", "index", "max_in_flight", "name", "num_in_flight", "num_outstanding_tokens")

    def __init__(self, name: str, max_in_flight: int, max_num_indexed_blocks: int,
                 health: ReplicaHealth | None) -> None:
        self.name = name
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.num_outstanding_tokens = 0
        self.index = PrefixIndex(max_num_indexed_blocks)
        self.health = health


class _Waiter:
    __slots__ = ("wake",)

    def __init__(self, wake: asyncio.Future[None]) -> None:
        self.wake = wake


class Balancer:
    """One pool's balancer. Single event loop (or single thread); not thread-safe."""

    def __init__(self, replica_names: Sequence[str], config: BalancerConfig = BalancerConfig(), *,
                 name_to_max_in_flight: Mapping[str, int] | None = None,
                 name_to_health: Mapping[str, ReplicaHealth] | None = None,
                 rng: random.Random | None = None) -> None:
        if not replica_names or len(set(replica_names)) != len(replica_names):
            raise ValueError("replica_names: must be non-empty and distinct")
        name_to_max_in_flight = name_to_max_in_flight or {}
        name_to_health = name_to_health or {}
        unknown = (set(name_to_max_in_flight) | set(name_to_health)) - set(replica_names)
        if unknown:
            raise ValueError(f"name_to_max_in_flight, name_to_health: unknown replicas {sorted(unknown)}")
        if any(n < 1 for n in name_to_max_in_flight.values()):
            raise ValueError("name_to_max_in_flight: must be >= 1")
        self.config = config
        self._rng = rng
        self._replicas = [
            _Replica(name, name_to_max_in_flight.get(name, config.max_in_flight), config.max_num_indexed_blocks,
                     name_to_health.get(name))
            for name in replica_names
        ]
        self._name_to_replica = {r.name: r for r in self._replicas}
        self._waiters: list[_Waiter] = []  # FIFO
        self._num_round_robin = 0
        for replica in self._replicas:
            if replica.health is not None:
                replica.health.subscribe(self._wake_waiters)  # a replica back up is a free slot

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def views(self) -> tuple[ReplicaView, ...]:
        return tuple(
            ReplicaView(r.name, r.num_in_flight, r.max_in_flight, r.num_outstanding_tokens, len(r.index),
                        r.health.view() if r.health is not None else None)
            for r in self._replicas
        )

    def pick(self, prompt_token_ids: Sequence[int] | None, num_tokens: int,
             exclude: Collection[str] = frozenset()) -> Choice:
        """The replica the rule chooses now; changes nothing (but round_robin's turn). Raises
        NoReplicaAvailable, PoolFull."""
        choice = self._decide(self._block_hashes(prompt_token_ids), num_tokens, exclude)
        if choice is None:
            raise PoolFull("every available replica is at max_in_flight", retry_after=self.config.retry_after)
        return choice

    def acquire(self, choice: Choice) -> Lease:
        """Take the slot pick chose: call it with no await since pick, or the pool may have moved."""
        replica = self._name_to_replica[choice.name]
        is_probe = False
        if replica.health is not None:
            is_probe = replica.health.breaker.state is BreakerState.HALF_OPEN
            # Claims the half-open probe; False only if the pool moved since pick (then go anyway,
            # the load must be counted for as long as the call runs).
            is_probe = replica.health.allow() and is_probe
        replica.num_in_flight += 1
        replica.num_outstanding_tokens += choice.num_tokens
        replica.index.insert(choice.block_hashes)
        return Lease(choice, replica.health, is_probe, self._release)

    def route(self, prompt_token_ids: Sequence[int] | None, num_tokens: int,
              exclude: Collection[str] = frozenset()) -> Lease:
        """pick + acquire, without queueing. Raises NoReplicaAvailable, PoolFull."""
        return self.acquire(self.pick(prompt_token_ids, num_tokens, exclude))

    async def acquire_slot(self, prompt_token_ids: Sequence[int] | None, num_tokens: int,
                           exclude: Collection[str] = frozenset(), timeout: float | None = None) -> Lease:
        """pick + acquire, waiting in the pool's FIFO queue while every available replica is full.

        timeout: seconds to wait (default config.queue_timeout; pass what is left of the call's
        deadline if that is sooner). Raises NoReplicaAvailable at once (or when it becomes so
        while waiting), PoolFull when the queue is full or the wait times out. A waiter holds no
        slot, so cancelling one leaks nothing.
        """
        block_hashes = self._block_hashes(prompt_token_ids)
        choice = self._decide(block_hashes, num_tokens, exclude)  # NoReplicaAvailable: at once
        if choice is not None and not self._waiters:  # else it queues behind them: first come, first served
            return self.acquire(choice)
        if len(self._waiters) >= self.config.max_queue:
            raise PoolFull(f"every replica is full and {len(self._waiters)} calls are queued",
                           retry_after=self.config.retry_after)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.queue_timeout if timeout is None else timeout)
        waiter = _Waiter(loop.create_future())
        self._waiters.append(waiter)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise PoolFull("every replica stayed full while this call waited",
                                   retry_after=self.config.retry_after)
                # Woken by a release or a probe verdict; a breaker's cooldown ends with no event.
                await asyncio.wait((waiter.wake,), timeout=min(remaining, self._seconds_until_half_open()))
                choice = self._decide(block_hashes, num_tokens, exclude)
                if choice is not None:
                    return self.acquire(choice)
                waiter.wake = loop.create_future()
        finally:
            self._waiters.remove(waiter)

    def _block_hashes(self, prompt_token_ids: Sequence[int] | None) -> tuple[int, ...]:
        if prompt_token_ids is None:
            return ()
        return tuple(prefix_block_hashes(prompt_token_ids, self.config.block_size))

    def _decide(self, block_hashes: tuple[int, ...], num_tokens: int, exclude: Collection[str]) -> Choice | None:
        """The rule in the module docstring; None when every available replica is full."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        name_to_reason: dict[str, str] = {}
        available: list[_Replica] = []
        for replica in self._replicas:
            unavailable = replica.health.unavailable_reason if replica.health is not None else None
            if replica.name in exclude:
                name_to_reason[replica.name] = "excluded"
            elif unavailable is not None:
                name_to_reason[replica.name] = unavailable.value
            else:
                available.append(replica)
        if not available:
            raise NoReplicaAvailable(
                "no replica can take the call: " + ", ".join(f"{n} {r}" for n, r in name_to_reason.items()),
                retry_after=self._retry_after_unavailable(name_to_reason), name_to_reason=name_to_reason)
        candidates = [r for r in available if r.num_in_flight < r.max_in_flight]
        if not candidates:
            return None
        config = self.config
        total_tokens = sum(r.num_outstanding_tokens for r in candidates) + num_tokens
        bound = config.balance_factor * total_tokens / len(candidates) + num_tokens + config.balance_slack_tokens
        chosen: _Replica | None = None
        num_matched_blocks = 0
        if config.policy == "round_robin":
            chosen = candidates[self._num_round_robin % len(candidates)]
            self._num_round_robin += 1
            num_matched_blocks = chosen.index.num_matched_blocks(block_hashes) if block_hashes else 0
            return Choice(chosen.name, "retry" if exclude else "round_robin", num_matched_blocks * config.block_size,
                          num_tokens, block_hashes)
        if block_hashes and config.policy == "cache_aware":
            within_bound = [r for r in candidates if r.num_outstanding_tokens + num_tokens <= bound]
            matches = [(r.index.num_matched_blocks(block_hashes), r) for r in within_bound]
            num_matched_blocks = max((m for m, _ in matches), default=0)
            if num_matched_blocks >= max(1, config.min_match_fraction * len(block_hashes)):
                best = [r for m, r in matches if m == num_matched_blocks]
                chosen = self._least_loaded(best)
            else:
                num_matched_blocks = 0
        if chosen is None:
            chosen = self._least_loaded(candidates)
            # least_loaded may still hit a prefix; report what it found there
            num_matched_blocks = chosen.index.num_matched_blocks(block_hashes) if block_hashes else 0
            reason: Reason = "least_loaded"
        else:
            reason = "affinity"
        if exclude:
            reason = "retry"
        return Choice(chosen.name, reason, num_matched_blocks * config.block_size, num_tokens, block_hashes)

    def _least_loaded(self, replicas: list[_Replica]) -> _Replica:
        least = min(r.num_outstanding_tokens for r in replicas)
        tied = [r for r in replicas if r.num_outstanding_tokens == least]
        return tied[0] if self._rng is None else self._rng.choice(tied)

    def _retry_after_unavailable(self, name_to_reason: Mapping[str, str]) -> float:
        """The soonest any of them may take a call: an open breaker's cooldown left, else the
        configured guess (a probe verdict, a busy probe call or an exclusion has no known end)."""
        waits = []
        for name, reason in name_to_reason.items():
            health = self._name_to_replica[name].health
            wait = health.retry_after() if health is not None and reason != "excluded" else None
            waits.append(self.config.retry_after if wait is None else wait)
        return min(waits)

    def _seconds_until_half_open(self) -> float:
        waits = [r.health.breaker.seconds_until_half_open() for r in self._replicas
                 if r.health is not None and r.health.breaker.state is BreakerState.OPEN]
        return min(waits, default=math.inf)

    def _release(self, lease: Lease) -> None:
        replica = self._name_to_replica[lease.name]
        replica.num_in_flight -= 1
        replica.num_outstanding_tokens -= lease.choice.num_tokens
        assert replica.num_in_flight >= 0 and replica.num_outstanding_tokens >= 0
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        # All of them, in FIFO order: the head may not fit the freed slot (its exclude names it),
        # and a woken waiter that was cancelled must not swallow the wake-up.
        for waiter in self._waiters:
            if not waiter.wake.done():
                waiter.wake.set_result(None)
