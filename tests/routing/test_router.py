"""Router (routing/router.py): a replica's failure before its first event is retried on another
replica, never after; a caller's 400 is not the replica's fault; a pool that is down or full
falls back along the chain; an open breaker refuses with Retry-After until its half-open probe;
the deadline is kept; a call closed half-way leaves no slot behind."""

from __future__ import annotations

import asyncio

import pytest

from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
)
from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.balancer import Balancer, BalancerConfig
from tokenway.routing.health import BreakerConfig, CircuitBreaker, ReplicaHealth
from tokenway.routing.router import Pool, Router

FINISHED = [ChoiceDelta(0, text="hello"), ChoiceDelta(0, text=" world", finish_reason="stop"), Usage(3, 2)]


class FakeReplica:
    """Plays a script per call: events, and an exception raised after `fail_after` events."""

    kind = "fake"

    def __init__(self, name: str, events=FINISHED, error: Exception | None = None, fail_after: int = 0) -> None:
        self.name, self.events, self.error, self.fail_after = name, list(events), error, fail_after
        self.num_calls = 0
        self.num_closed = 0

    async def generate(self, job):
        self.num_calls += 1
        try:
            for position, event in enumerate(self.events):
                if self.error is not None and position == self.fail_after:
                    raise self.error
                yield event
                await asyncio.sleep(0)
            if self.error is not None and self.fail_after >= len(self.events):
                raise self.error
        finally:
            self.num_closed += 1

    async def probe(self) -> bool:
        return True

    def stats(self) -> None:
        return None

    async def aclose(self) -> None:
        pass


def job(model: str = "m", deadline: float | None = None) -> GenerationJob:
    return GenerationJob("cmpl-1", model, "completion", SamplingParams(max_tokens=8), prompt="hi",
                         prompt_token_ids=tuple(range(40)), deadline=deadline)


def pool(name: str, replicas, clock=None, breaker=BreakerConfig(failure_threshold=2, cooldown=5.0),
         **config) -> Pool:
    healths = {r.name: ReplicaHealth(r.name, CircuitBreaker(breaker, clock) if clock else CircuitBreaker(breaker))
               for r in replicas}
    balancer = Balancer([r.name for r in replicas], BalancerConfig(**config), name_to_health=healths)
    return Pool(name, {r.name: r for r in replicas}, balancer, healths)


def run(router: Router, the_job: GenerationJob):
    """(events, [ReplicaChoice]) of one call, or raises its error."""
    choices = []

    async def main():
        return [event async for event in router.generate(the_job, choices.append)]

    return asyncio.run(main()), choices


def test_a_failure_before_the_first_event_is_retried_on_another_replica():
    broken = FakeReplica("a", error=BadGatewayError("upstream a closed the connection"))
    good = FakeReplica("b")
    the_pool = pool("m", [broken, good])
    # Make the broken one the balancer's first pick: the least loaded tie goes by pool order.
    events, choices = run(Router({"m": the_pool}), job())
    assert events == FINISHED and broken.num_calls == 1 and good.num_calls == 1
    assert [(c.replica, c.reason, c.num_failed_attempts) for c in choices] == [("b", "retry", 1)]
    assert the_pool.healths["a"].breaker.num_recent_failures == 1
    assert all(view.num_in_flight == 0 for view in the_pool.balancer.views())


def test_a_failure_after_the_first_event_is_never_retried():
    cut = FakeReplica("a", error=BadGatewayError("upstream a closed mid-stream"), fail_after=1)
    good = FakeReplica("b")
    received = []

    async def main():
        async for event in Router({"m": pool("m", [cut, good])}).generate(job(), lambda choice: None):
            received.append(event)

    with pytest.raises(BadGatewayError):
        asyncio.run(main())
    assert received == FINISHED[:1] and good.num_calls == 0


def test_a_callers_error_is_not_the_replicas_fault_and_is_not_retried():
    refusing = FakeReplica("a", error=InvalidRequestError("max_tokens: too large", param="max_tokens"))
    good = FakeReplica("b")
    the_pool = pool("m", [refusing, good])
    with pytest.raises(InvalidRequestError):
        run(Router({"m": the_pool}), job())
    assert good.num_calls == 0 and the_pool.healths["a"].breaker.num_recent_failures == 0


def test_a_pool_that_is_down_falls_back_and_the_choice_says_so():
    large = FakeReplica("large-1")
    small = FakeReplica("small-1")
    large_pool = pool("large", [large])
    large_pool.healths["large-1"].record_probe(False, "connection refused")
    router = Router({"large": large_pool, "small": pool("small", [small])},
                    fallback_chain=lambda name: ("large", "small") if name == "large" else (name,))
    events, choices = run(router, job("large"))
    assert events == FINISHED and large.num_calls == 0
    assert [(c.pool, c.replica, c.reason) for c in choices] == [("small", "small-1", "fallback")]


def test_failures_open_the_breaker_and_the_half_open_probe_comes_after_the_cooldown(clock):
    failing = FakeReplica("a", error=BadGatewayError("upstream a answered 500"))
    router = Router({"m": pool("m", [failing], clock=clock)})
    for _ in range(2):  # failure_threshold=2
        with pytest.raises(BadGatewayError):
            run(router, job())
    with pytest.raises(ServiceUnavailableError) as refused:
        run(router, job())
    assert refused.value.code == "no_replica_available" and refused.value.retry_after > 0
    assert failing.num_calls == 2  # the open breaker kept the third call away from it
    clock.advance(5.0)
    failing.error = None  # it recovered: the half-open probe call succeeds and closes the breaker
    events, _ = run(router, job())
    assert events == FINISHED and failing.num_calls == 3
    assert run(router, job())[0] == FINISHED


def test_a_full_pool_with_a_full_queue_is_a_429_with_retry_after():
    slow = FakeReplica("a")
    router = Router({"m": pool("m", [slow], max_in_flight=1, max_queue=0)})

    async def main():
        first = router.generate(job(), lambda choice: None)
        await first.__anext__()  # holds the only slot
        try:
            with pytest.raises(RateLimitError) as full:
                async for _ in router.generate(job(), lambda choice: None):
                    pass
            return full.value
        finally:
            await first.aclose()

    error = asyncio.run(main())
    assert error.code == "pool_full" and error.retry_after > 0


def test_a_passed_deadline_is_a_504_before_any_replica_runs():
    idle = FakeReplica("a")
    with pytest.raises(GatewayTimeoutError):
        run(Router({"m": pool("m", [idle])}), job(deadline=0.0))
    assert idle.num_calls == 0


def test_closing_the_call_half_way_closes_the_replica_and_frees_its_slot():
    replica = FakeReplica("a")
    the_pool = pool("m", [replica])

    async def main():
        events = Router({"m": the_pool}).generate(job(), lambda choice: None)
        await events.__anext__()
        await events.aclose()

    asyncio.run(main())
    assert replica.num_closed == 1 and the_pool.balancer.views()[0].num_in_flight == 0
    assert the_pool.healths["a"].breaker.num_recent_failures == 0  # a client leaving is nobody's failure
