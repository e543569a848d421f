"""Stage 2: which replica runs a call, and what happens when it cannot.

    job ─► Router.generate(job, on_replica)
             for each model of the fallback chain (the asked one, then its fallbacks):
               lease = pool.balancer.acquire_slot(prompt ids, prompt + max_tokens, exclude=tried)
                 NoReplicaAvailable / PoolFull ─► the next model of the chain
               replica.generate(job) ─► events, forwarded as they come
                 fails before its first event, the replica's fault ─► record it (the breaker),
                                                                      try another replica
                 fails after its first event ─► the call fails: bytes already left, never retried
             nothing left ─► 503 (or 429 for a full pool) with Retry-After

Each replica's health (a circuit breaker fed by the outcomes here, and the active probes of a
HealthChecker per pool) decides whether the balancer may pick it. `on_replica` hears once which
replica the call ran on, and why (ReplicaChoice): the trace's routing stage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

from tokenway.protocol.errors import GatewayTimeoutError, RateLimitError, ServiceUnavailableError, TokenwayError
from tokenway.protocol.job import GenerationJob, ReplicaEvent, Usage
from tokenway.routing.balancer import Balancer, BalancerConfig, NoReplicaAvailable, PoolFull, RoutingError
from tokenway.routing.health import BreakerConfig, CircuitBreaker, HealthCheckConfig, HealthChecker, ReplicaHealth
from tokenway.routing.replicas import Replica
from tokenway.routing.upstream_errors import is_replica_fault


@dataclass(frozen=True, slots=True)
class ReplicaChoice:
    """Where a call ran: its pool (the model served, a fallback's when one took it), the
    replica, why that one, and how many replicas failed it first."""

    pool: str
    replica: str
    reason: str  # "only", "affinity", "least_loaded", "retry", "fallback"
    num_failed_attempts: int = 0


@dataclass(slots=True)
class ReplicaTally:
    """What this gateway has seen a replica do since start: calls that ran there (ok or not),
    the failures counted against it, and the tokens of the usage it reported. Its prefix-cache
    hit rate is the cached share of the prompt tokens, whatever the replica is (an upstream's
    own cache too, where it reports cached tokens)."""

    num_calls: int = 0
    num_failures: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {"num_calls": self.num_calls, "num_failures": self.num_failures, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
                "prefix_cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None}


@dataclass(slots=True)
class Pool:
    """One model's replicas, their health, and the balancer that picks among them."""

    name: str
    replicas: Mapping[str, Replica]
    balancer: Balancer
    healths: Mapping[str, ReplicaHealth] = field(default_factory=dict)
    checker: HealthChecker | None = None
    tallies: dict[str, ReplicaTally] = field(default_factory=dict)  # only Router.generate writes these
    # replica -> this gateway's calls of service class "batch" running there (the rest of its
    # leases are interactive): what batch_room.py leaves to interactive calls. Router.generate's.
    name_to_num_batch: dict[str, int] = field(default_factory=dict)

    def tally(self, name: str) -> ReplicaTally:
        tally = self.tallies.get(name)
        if tally is None:
            tally = self.tallies[name] = ReplicaTally()
        return tally

    @classmethod
    def of(cls, name: str, replicas: list[Replica], balancer: BalancerConfig = BalancerConfig(),
           breaker: BreakerConfig = BreakerConfig(), health: HealthCheckConfig = HealthCheckConfig(),
           name_to_max_in_flight: Mapping[str, int] | None = None) -> Pool:
        """The pool of `replicas`: a breaker each, the balancer over them, and the active probes
        (started by Router.start)."""
        healths = {r.name: ReplicaHealth(r.name, CircuitBreaker(breaker)) for r in replicas}
        return cls(name, {r.name: r for r in replicas},
                   Balancer([r.name for r in replicas], balancer, name_to_max_in_flight=name_to_max_in_flight,
                            name_to_health=healths),
                   healths, HealthChecker({r.name: r.probe for r in replicas}, healths, health))


class Router:
    def __init__(self, pools: Mapping[str, Pool], fallback_chain: Callable[[str], tuple[str, ...]] | None = None
                 ) -> None:
        self.pools = dict(pools)
        # model name -> the pools to try, in order (the registry's fallback chain); default: its own
        self._fallback_chain = fallback_chain or (lambda name: (name,))

    def unique_pools(self) -> list[Pool]:
        """Each pool once (a model's aliases share its pool)."""
        return list({id(pool): pool for pool in self.pools.values()}.values())

    def is_available(self, name: str) -> bool:
        """Some replica of the model's pool may take a call now (up, breaker not open)."""
        pool = self.pools[name]
        return any(health.unavailable_reason is None for health in pool.healths.values()) or not pool.healths

    def is_servable(self, name: str) -> bool:
        """The model's pool, or one of its fallbacks, may take a call now."""
        return any(self.is_available(pool_name) for pool_name in self._fallback_chain(name))

    def stats(self) -> dict[str, dict[str, dict]]:
        """pool -> replica -> its load and health, as the dashboard and /engine/stats show them."""
        stats: dict[str, dict[str, dict]] = {}
        for pool in self.unique_pools():
            replicas = stats[pool.name] = {}
            for view in pool.balancer.views():
                health = pool.healths.get(view.name)
                reason = health.unavailable_reason if health is not None else None
                replicas[view.name] = {"kind": pool.replicas[view.name].kind, "available": reason is None,
                                       "unavailable_reason": reason, "num_in_flight": view.num_in_flight,
                                       "num_outstanding_tokens": view.num_outstanding_tokens,
                                       **pool.tally(view.name).as_dict()}
        return stats

    def start(self) -> None:
        """Start the pools' active health checks (on the running event loop)."""
        for pool in self.unique_pools():
            if pool.checker is not None:
                pool.checker.start()

    async def aclose(self) -> None:
        for pool in self.unique_pools():
            if pool.checker is not None:
                await pool.checker.stop()
            for replica in pool.replicas.values():
                await replica.aclose()

    async def generate(self, job: GenerationJob, on_replica: Callable[[ReplicaChoice], None]
                       ) -> AsyncGenerator[ReplicaEvent, None]:
        """The job's events from the first replica able to run it (see the module's docstring)."""
        chain = self._fallback_chain(job.model)
        refusal: RoutingError | None = None
        last_fault: TokenwayError | None = None
        num_failed = 0
        for position, pool_name in enumerate(chain):
            pool = self.pools[pool_name]
            tried: set[str] = set()
            while True:
                try:
                    lease = await pool.balancer.acquire_slot(job.prompt_token_ids, job.num_reserved_tokens,
                                                             exclude=tried, timeout=_time_left(job))
                except RoutingError as exc:
                    refusal = exc
                    break  # this pool cannot take it: the next model of the chain
                if position > 0:
                    reason = "fallback"
                elif len(pool.replicas) == 1:
                    reason = "only"
                else:
                    reason = lease.choice.reason
                replica, tally = pool.replicas[lease.name], pool.tally(lease.name)
                tally.num_calls += 1
                started = False
                with lease, _counted(pool.name_to_num_batch, lease.name, job.service_class == "batch"):
                    try:
                        async with aclosing(replica.generate(job)) as events:
                            async for event in events:
                                if not started:
                                    started = True
                                    on_replica(ReplicaChoice(pool_name, lease.name, reason, num_failed))
                                if isinstance(event, Usage):
                                    tally.prompt_tokens += event.prompt_tokens
                                    tally.cached_tokens += event.cached_tokens
                                    tally.completion_tokens += event.completion_tokens
                                yield event
                    except TokenwayError as exc:
                        if not is_replica_fault(exc):
                            lease.record_success()  # the caller's error (a 400): the replica is fine
                            raise
                        lease.record_failure()
                        tally.num_failures += 1
                        if started:
                            raise  # bytes already left for the client: never run it twice
                        tried.add(lease.name)
                        num_failed += 1
                        last_fault = exc
                        continue
                    lease.record_success()
                    return
        on_replica(ReplicaChoice(chain[-1], "", "none", num_failed))
        raise _exhausted(refusal, last_fault)


@contextmanager
def _counted(name_to_count: dict[str, int], name: str, counts: bool) -> Iterator[None]:
    if not counts:
        yield
        return
    name_to_count[name] = name_to_count.get(name, 0) + 1
    try:
        yield
    finally:
        name_to_count[name] -= 1


def _time_left(job: GenerationJob) -> float | None:
    if job.deadline is None:
        return None
    left = job.deadline - time.monotonic()
    if left <= 0:
        raise GatewayTimeoutError("The request's deadline passed before a replica could take it.")
    return left


def _exhausted(refusal: RoutingError | None, last_fault: TokenwayError | None) -> TokenwayError:
    """Every replica of every pool in the chain refused or failed the call before its first byte."""
    if last_fault is not None and (refusal is None or isinstance(refusal, NoReplicaAvailable)):
        return last_fault  # the replicas' own error (a 502, a 504...) says the most
    retry_after = refusal.retry_after if refusal is not None else 1.0
    if isinstance(refusal, PoolFull):
        return RateLimitError("Every replica of this model is at capacity and its queue is full; retry shortly.",
                              retry_after=retry_after, code="pool_full")
    return ServiceUnavailableError("No replica of this model is available now; retry shortly.",
                                   retry_after=retry_after, code="no_replica_available")
