"""Leases: a slice of a key's limits held for one worker (limits.py lease_now), and the
worker's limiter that admits calls from them (gateway/leases.py)."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time

import pytest

from tokenway.gateway import leases
from tokenway.gateway.budgets import BudgetState, InProcessBudgets
from tokenway.gateway.counters import CounterClient, CounterServer, RemoteBudgets, RemoteLimiter
from tokenway.gateway.leases import LeasedBudgets, LeasedLimiter
from tokenway.gateway.limits import LEASE_PART, InProcessLimiter, LimitSpec, LimitsUnavailable


async def no_spend(key_id: str) -> float:
    return 0.0


def run_with_owner(test, loop_factory, limiter: InProcessLimiter | None = None) -> None:
    """test(path, owner's limiter) against a CounterServer on a unix socket under a short path."""
    owner = limiter or InProcessLimiter()

    async def main(path: str) -> None:
        server = CounterServer(owner, InProcessBudgets(no_spend))
        await server.start(path)
        try:
            await test(path, owner)
        finally:
            await server.close()

    with tempfile.TemporaryDirectory(prefix="tw-") as folder, asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main(f"{folder}/c.sock"))


def workers(path: str, n: int) -> list[LeasedLimiter]:
    return [LeasedLimiter(RemoteLimiter(CounterClient(path))) for _ in range(n)]


def remaining_requests(owner: InProcessLimiter, key_id: str, rpm: int) -> int:
    return int(owner.headers_now(key_id, LimitSpec(rpm=rpm))["x-ratelimit-remaining-requests"])


# ---- The owner's side. ----

def test_a_lease_takes_at_most_its_part_of_each_limit_and_counts_at_once():
    owner = InProcessLimiter()
    spec = LimitSpec(rpm=160, tpm=16_000)
    lease = owner.lease_now("k", spec, 1000, 10**6, 5)
    assert lease is not None
    assert (lease.num_requests, lease.num_tokens) == (160 // LEASE_PART, 16_000 // LEASE_PART)
    assert (lease.num_window_requests, lease.num_window_tokens) == (0, 0)  # the window before it
    headers = owner.headers_now("k", spec)
    assert headers["x-ratelimit-remaining-requests"] == str(160 - 10)
    assert headers["x-ratelimit-remaining-tokens"] == str(16_000 - 1000)
    # Settled to what its calls used, the rest is free again.
    owner.settle_lease_now("k", lease.lease_id, 3, 120)
    headers = owner.headers_now("k", spec)
    assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-remaining-tokens"]) == ("157", "15880")


def test_no_lease_where_a_call_must_be_asked_for_itself():
    owner = InProcessLimiter()
    assert owner.lease_now("k", LimitSpec(rpm=1000, max_concurrent=4), 8, 8, 1) is None  # slots live at the owner
    assert owner.lease_now("k", LimitSpec(rpm=LEASE_PART - 1), 8, 8, 1) is None  # its part is not one request
    assert owner.lease_now("k", LimitSpec(tpm=1600), 8, 800, 101) is None  # the call is larger than the part
    # Only what is free now: a key at its limit gets none, one near it only the rest.
    for _ in range(31):
        assert owner.admit_now("full", LimitSpec(rpm=32), 0).allowed
    lease = owner.lease_now("full", LimitSpec(rpm=32), 8, 8, 0)
    assert lease is not None and lease.num_requests == 1
    assert owner.lease_now("full", LimitSpec(rpm=32), 8, 8, 0) is None
    with pytest.raises(ValueError):
        owner.lease_now("k", LimitSpec(rpm=1000), 0, 8, 1)
    with pytest.raises(ValueError):
        owner.settle_lease_now("full", lease.lease_id, -1, 0)


def test_a_lease_counts_until_a_window_after_its_last_moment():
    # A call admitted from the lease at its last moment counts a whole window from then: so
    # does the lease, and not a moment less.
    owner = InProcessLimiter(window_s=0.4, lease_s=0.2)
    spec = LimitSpec(rpm=32)
    lease = owner.lease_now("k", spec, 2, 0, 0)
    assert lease is not None and lease.num_requests == 2
    granted = time.monotonic()
    while time.monotonic() - granted < 0.5:  # past a window from the grant, not from its end
        assert remaining_requests(owner, "k", 32) == 30
        time.sleep(0.02)
    time.sleep(0.15)
    assert remaining_requests(owner, "k", 32) == 32
    owner.settle_lease_now("k", lease.lease_id, 1, 0)  # gone from the window: nothing to settle
    assert remaining_requests(owner, "k", 32) == 32


def test_a_refusal_waits_for_the_lease_to_leave_the_window():
    owner = InProcessLimiter(window_s=10, lease_s=2)
    spec = LimitSpec(rpm=16, tpm=160)
    assert owner.lease_now("k", spec, 1, 10, 0) is not None
    for _ in range(15):
        assert owner.admit_now("k", spec, 1).allowed
    refused = owner.admit_now("k", spec, 1)
    assert not refused.allowed and refused.limit_kind == "requests"
    # The oldest of the 16 is the first admission (now), not the lease (now + 2 s).
    assert refused.retry_after_s is not None and 9 < refused.retry_after_s <= 10
    # Tokens: the lease's 10 leave last, at now + 2 s + the window.
    too_many = owner.admit_now("k", LimitSpec(tpm=160), 160)  # all 25 in the window must leave
    assert not too_many.allowed and too_many.retry_after_s is not None and 11 < too_many.retry_after_s <= 12
    assert owner.headers_now("k", spec)["x-ratelimit-reset-requests"].startswith("12")  # the lease's, not 10s


def test_leases_and_calls_at_random_never_pass_a_limit():
    """Any mix of leases, calls, settlements: the window never counts more than the limits, and
    never fewer than what was admitted."""
    rng = random.Random(7)
    owner = InProcessLimiter(window_s=3600, lease_s=1)
    spec = LimitSpec(rpm=200, tpm=5000)
    admitted_requests = admitted_tokens = 0
    leases_out = []
    for _ in range(2000):
        roll = rng.random()
        if roll < 0.4:
            tokens = rng.randrange(0, 60)
            if owner.admit_now("k", spec, tokens).allowed:
                admitted_requests, admitted_tokens = admitted_requests + 1, admitted_tokens + tokens
        elif roll < 0.7:
            lease = owner.lease_now("k", spec, rng.randrange(1, 30), 400, rng.randrange(0, 40))
            if lease is not None:
                leases_out.append([lease, 0, 0])
        elif leases_out:
            held = rng.choice(leases_out)
            lease, used_requests, used_tokens = held
            if used_requests < lease.num_requests:
                tokens = rng.randrange(0, 30)
                if used_tokens + tokens <= lease.num_tokens:  # the worker admits from it
                    held[1], held[2] = used_requests + 1, used_tokens + tokens
                    admitted_requests, admitted_tokens = admitted_requests + 1, admitted_tokens + tokens
            if rng.random() < 0.3:  # the lease ends: settled to what it holds
                owner.settle_lease_now("k", lease.lease_id, held[1], held[2])
                leases_out.remove(held)
        headers = owner.headers_now("k", spec)
        requests = 200 - int(headers["x-ratelimit-remaining-requests"])
        tokens = 5000 - int(headers["x-ratelimit-remaining-tokens"])
        assert admitted_requests <= requests <= 200 and admitted_tokens <= tokens <= 5000
    assert admitted_requests > 150  # the key's limit was reached, and used


# ---- The workers' side. ----

def test_rpm_is_exact_across_leasing_workers(loop_factory):
    async def test(path: str, owner: InProcessLimiter) -> None:
        limiters = workers(path, 4)
        spec = LimitSpec(rpm=64)
        decisions = await asyncio.gather(*(limiters[i % 4].admit("k", spec, 3) for i in range(200)))
        admitted = [d for d in decisions if d.allowed]
        assert len(admitted) == 64  # no more, and none of the limit left unused by the leases
        assert {d.limit_kind for d in decisions if not d.allowed} == {"requests"}
        assert remaining_requests(owner, "k", 64) == 0
        for limiter in limiters:
            await limiter.close()

    run_with_owner(test, loop_factory)


def test_most_calls_are_admitted_without_asking_the_owner(loop_factory):
    async def test(path: str, owner: InProcessLimiter) -> None:
        asked = []
        admit_now, lease_now = owner.admit_now, owner.lease_now
        owner.admit_now = lambda *args: asked.append("admit") or admit_now(*args)  # type: ignore[method-assign]
        owner.lease_now = lambda *args: asked.append("lease") or lease_now(*args)  # type: ignore[method-assign]
        [limiter] = workers(path, 1)
        spec = LimitSpec(rpm=10**6, tpm=10**9)
        for _ in range(10):
            results = await asyncio.gather(*(limiter.admit("k", spec, 40) for _ in range(100)))
            assert all(d.allowed for d in results)
            for d in results:
                assert d.reservation is not None
                await limiter.reconcile(d.reservation, 10)
        assert len(asked) < 15 and "admit" not in asked  # leases of 8, 16, 32, ... requests
        last = results[-1].headers
        assert int(last["x-ratelimit-remaining-requests"]) <= 10**6 - 1000
        await limiter.close()
        # Once closed, its leases are settled: the owner counts what the calls used, no more.
        headers = owner.headers_now("k", spec)
        assert headers["x-ratelimit-remaining-requests"] == str(10**6 - 1000)
        assert headers["x-ratelimit-remaining-tokens"] == str(10**9 - 1000 * 10)

    run_with_owner(test, loop_factory)


def test_a_call_that_ends_after_its_lease_is_settled_at_the_owner(loop_factory, monkeypatch):
    monkeypatch.setattr(leases, "SETTLE_EVERY_S", 0.01)

    async def test(path: str, owner: InProcessLimiter) -> None:
        [limiter] = workers(path, 1)
        spec = LimitSpec(tpm=100_000)
        decision = await limiter.admit("k", spec, 500)
        assert decision.allowed and decision.reservation is not None
        await asyncio.sleep(0.25)  # the lease (0.1 s) ends, the call still holding its 500 tokens
        assert owner.headers_now("k", spec)["x-ratelimit-remaining-tokens"] == str(100_000 - 500)
        await limiter.reconcile(decision.reservation, 30)
        await asyncio.sleep(0.1)
        assert owner.headers_now("k", spec)["x-ratelimit-remaining-tokens"] == str(100_000 - 30)
        await limiter.close()

    run_with_owner(test, loop_factory, InProcessLimiter(lease_s=0.1))


def test_no_call_is_admitted_from_a_lease_after_its_time(loop_factory):
    async def test(path: str, owner: InProcessLimiter) -> None:
        [limiter] = workers(path, 1)
        spec = LimitSpec(rpm=1600)
        assert (await limiter.admit("k", spec, 0)).allowed
        first = limiter._keys["k"].current
        assert first is not None
        await asyncio.sleep(0.1)
        assert (await limiter.admit("k", spec, 0)).allowed
        assert limiter._keys["k"].current is not first and first.num_calls == 1
        await limiter.close()

    run_with_owner(test, loop_factory, InProcessLimiter(lease_s=0.05))


def test_tokens_stay_exact_and_come_back_when_calls_end(loop_factory):
    async def test(path: str, owner: InProcessLimiter) -> None:
        limiters = workers(path, 3)
        spec = LimitSpec(tpm=1600)
        decisions = await asyncio.gather(*(limiters[i % 3].admit("k", spec, 20) for i in range(120)))
        admitted = [(i % 3, d) for i, d in enumerate(decisions) if d.allowed]
        assert len(admitted) == 80
        # Each call used 5 of its 20: its 15 come back, to its lease or to the owner.
        for worker, d in admitted:
            assert d.reservation is not None
            await limiters[worker].reconcile(d.reservation, 5)
        for limiter in limiters:
            await limiter.close()
        assert owner.headers_now("k", spec)["x-ratelimit-remaining-tokens"] == str(1600 - 80 * 5)

    run_with_owner(test, loop_factory)


def test_calls_a_lease_cannot_hold_are_asked_of_the_owner(loop_factory):
    async def test(path: str, owner: InProcessLimiter) -> None:
        asked = []
        admit_now = owner.admit_now
        owner.admit_now = lambda *args: asked.append(args[0]) or admit_now(*args)  # type: ignore[method-assign]
        [limiter] = workers(path, 1)
        assert (await limiter.admit("slots", LimitSpec(rpm=1000, max_concurrent=2), 1)).allowed
        share = LimitSpec(rpm=500)
        assert (await limiter.admit("batch", LimitSpec(rpm=1000), 1, share)).allowed
        assert (await limiter.admit("small", LimitSpec(rpm=3), 1)).allowed
        assert (await limiter.admit("big", LimitSpec(tpm=1600), 500)).allowed  # over its part (100)
        assert asked == ["slots", "batch", "small", "big"]
        # A key with no limits is admitted with nothing asked, and nothing to settle.
        free = await limiter.admit("free", LimitSpec(), 10)
        assert free.allowed and free.headers == {} and free.reservation is not None
        await limiter.reconcile(free.reservation, 3)
        assert asked == ["slots", "batch", "small", "big"] and "free" not in owner._key_to_state
        await limiter.close()

    run_with_owner(test, loop_factory)


def test_an_owner_that_is_gone_is_limits_unavailable(tmp_path, loop_factory):
    async def main() -> None:
        limiter = LeasedLimiter(RemoteLimiter(CounterClient(tmp_path / "nobody.sock", timeout_s=1)))
        with pytest.raises(LimitsUnavailable):
            await limiter.admit("k", LimitSpec(rpm=1000), 0)
        await limiter.close()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


# ---- Budgets. ----

def budget_workers(path: str, n: int) -> list[LeasedBudgets]:
    return [LeasedBudgets(RemoteBudgets(CounterClient(path))) for _ in range(n)]


def test_a_budget_lease_is_a_hold_settled_in_steps():
    async def main() -> None:
        owner = InProcessBudgets(no_spend)
        budget = 16 * 10**6
        assert owner.lease_now("k", budget, 10**6, 1) is None  # not seeded yet
        await owner.reserve("k", budget, 0)  # seeds it
        lease = owner.lease_now("k", budget, 10**9, 1)
        assert lease is not None and lease.nanos == budget // LEASE_PART
        assert owner.state_now("k") == BudgetState(0, 10**6)
        owner.settle_lease_now("k", lease.reservation_id, 300, 200)  # 300 spent, 200 still held by calls
        assert owner.state_now("k") == BudgetState(300, 200)
        owner.settle_lease_now("k", lease.reservation_id, 150, 0)
        assert owner.state_now("k") == BudgetState(450, 0)
        owner.settle_lease_now("k", lease.reservation_id, 10, 0)  # a step after the last: still owed
        assert owner.state_now("k") == BudgetState(460, 0)
        # Only what is free now, and never below the call's own worst case.
        assert owner.lease_now("k", budget, budget, budget) is None  # more than its part
        await owner.reserve("k", budget, budget - 460 - 10)
        small = owner.lease_now("k", budget, 10**6, 5)
        assert small is not None and small.nanos == 10

    asyncio.run(main())


def test_a_budget_is_exact_across_leasing_workers(loop_factory):
    async def test(path: str, owner: InProcessLimiter) -> None:
        stores = budget_workers(path, 3)
        budget, worst = 16 * 10**6, 10**5  # 160 calls' worst cases
        first = await stores[0].reserve("k", budget, worst)  # seeds the key, at the owner
        assert first.reservation is not None
        await stores[0].settle(first.reservation, worst)
        decisions = await asyncio.gather(*(stores[i % 3].reserve("k", budget, worst) for i in range(300)))
        admitted = [(i % 3, d) for i, d in enumerate(decisions) if d.allowed]
        assert len(admitted) == 159
        for worker, d in admitted:
            assert d.reservation is not None
            await stores[worker].settle(d.reservation, worst // 2)  # each cost half its worst case
        for store in stores:
            await store.close()
        state = await RemoteBudgets(CounterClient(path)).state("k")
        assert state == BudgetState(worst + 159 * worst // 2, 0)

    run_with_owner(test, loop_factory)


def test_a_settlement_the_owner_could_not_hear_is_sent_again_whole(loop_factory, monkeypatch):
    # The owner's link fails for the first settlement of a budget lease: nothing of what its
    # calls cost is lost; the next step carries it, and the calls that ended since.
    monkeypatch.setattr(leases, "SETTLE_EVERY_S", 0.01)
    monkeypatch.setattr(leases, "SETTLE_AGAIN_S", 0.05)

    class Flaky(RemoteBudgets):
        failures = 1

        async def settle_lease(self, key_id: str, reservation_id: str, cost_nanos: int, held_nanos: int) -> None:
            if self.failures:
                self.failures -= 1
                raise LimitsUnavailable("the owner's socket is gone")
            await super().settle_lease(key_id, reservation_id, cost_nanos, held_nanos)

    async def test(path: str, owner: InProcessLimiter) -> None:
        store = LeasedBudgets(Flaky(CounterClient(path)))
        budget = 16 * 10**6
        first = await store.reserve("k", budget, 1000)  # seeds the key, at the owner
        assert first.reservation is not None
        await store.settle(first.reservation, 1000)
        decisions = [await store.reserve("k", budget, 1000) for _ in range(5)]
        held = store._keys["k"].current
        assert held is not None and all(d.allowed for d in decisions)
        for d in decisions[:3]:
            assert d.reservation is not None
            await store.settle(d.reservation, 400)
        store._end(store._keys["k"], held)  # its time is up: the first step fails
        await asyncio.sleep(0.03)
        for d in decisions[3:]:
            assert d.reservation is not None
            await store.settle(d.reservation, 400)
        await asyncio.sleep(0.2)
        state = await RemoteBudgets(CounterClient(path)).state("k")
        assert state == BudgetState(1000 + 5 * 400, 0)
        await store.close()

    run_with_owner(test, loop_factory)
