"""Leases: a slice of a key's limits held for one gateway process (limits.py lease_now; in
Redis, limits_redis.py), and the process's limiter that admits calls from them
(gateway/leases.py). The owner's side runs on both owners: in process and a real Redis."""

from __future__ import annotations

import asyncio
import functools
import random
import tempfile
import time
import uuid

import pytest

from tokenway.gateway import leases
from tokenway.gateway.budgets import BudgetLease, BudgetState, InProcessBudgets
from tokenway.gateway.counters import CounterClient, CounterServer, RemoteBudgets, RemoteLimiter
from tokenway.gateway.leases import LeasedBudgets, LeasedLimiter
from tokenway.gateway.limits import LEASE_PART, InProcessLimiter, LeaseOwner, LimitSpec, LimitsUnavailable


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


# ---- The owner's side, in process and in Redis. ----

@pytest.fixture(params=["memory", "redis"])
def owner_of(request):
    """A lease owner's factory (windows as keyword arguments), called inside the test's loop."""
    if request.param == "memory":
        return InProcessLimiter
    from tokenway.gateway.limits_redis import RedisLimiter

    return functools.partial(RedisLimiter, request.getfixturevalue("redis_url"))


def run_owner(owner_of, body, **windows) -> None:
    """body(owner, key) on a fresh owner and a key no earlier run has used (a Redis outlives runs)."""
    async def main() -> None:
        owner = owner_of(**windows)
        try:
            await body(owner, f"lease-{uuid.uuid4().hex[:12]}")
        finally:
            await owner.close()

    asyncio.run(main())


async def remaining(owner: LeaseOwner, key_id: str, spec: LimitSpec) -> tuple[int, int]:
    """The key's remaining requests and tokens, as its rate headers say (a spec with rpm and tpm)."""
    headers = await owner.headers(key_id, spec)
    return int(headers["x-ratelimit-remaining-requests"]), int(headers["x-ratelimit-remaining-tokens"])


def test_a_lease_takes_at_most_its_part_of_each_limit_and_counts_at_once(owner_of):
    async def body(owner: LeaseOwner, key: str) -> None:
        spec = LimitSpec(rpm=160, tpm=16_000)
        lease = await owner.lease(key, spec, 1000, 10**6, 5)
        assert lease is not None
        assert (lease.num_requests, lease.num_tokens) == (160 // LEASE_PART, 16_000 // LEASE_PART)
        assert (lease.num_window_requests, lease.num_window_tokens) == (0, 0)  # the window before it
        assert await remaining(owner, key, spec) == (160 - 10, 16_000 - 1000)
        # A second lease sees the first in the window.
        second = await owner.lease(key, spec, 4, 100, 5)
        assert second is not None and (second.num_window_requests, second.num_window_tokens) == (10, 1000)
        # Settled to what its calls used, the rest is free again; settled again as that changes.
        await owner.settle_lease(lease, 3, 120)
        assert await remaining(owner, key, spec) == (160 - 3 - 4, 16_000 - 120 - 100)
        await owner.settle_lease(lease, 0, 0)
        await owner.settle_lease(second, 0, 7)
        assert await remaining(owner, key, spec) == (160, 16_000 - 7)

    run_owner(owner_of, body)


def test_no_lease_where_a_call_must_be_asked_for_itself(owner_of):
    async def body(owner: LeaseOwner, key: str) -> None:
        assert await owner.lease(key, LimitSpec(rpm=1000, max_concurrent=4), 8, 8, 1) is None  # slots: at the owner
        assert await owner.lease(key, LimitSpec(rpm=LEASE_PART - 1), 8, 8, 1) is None  # its part is not one request
        assert await owner.lease(key, LimitSpec(tpm=1600), 8, 800, 101) is None  # the call is larger than the part
        # Only what is free now: a key at its limit gets none, one near it only the rest.
        full = key + "-full"
        for _ in range(31):
            assert (await owner.admit(full, LimitSpec(rpm=32), 0)).allowed
        lease = await owner.lease(full, LimitSpec(rpm=32), 8, 8, 0)
        assert lease is not None and lease.num_requests == 1
        assert await owner.lease(full, LimitSpec(rpm=32), 8, 8, 0) is None
        refused = await owner.admit(full, LimitSpec(rpm=32), 0)
        assert not refused.allowed and refused.limit_kind == "requests"
        with pytest.raises(ValueError):
            await owner.lease(key, LimitSpec(rpm=1000), 0, 8, 1)
        with pytest.raises(ValueError):
            await owner.settle_lease(lease, -1, 0)

    run_owner(owner_of, body)


def test_a_lease_counts_until_a_window_after_its_last_moment(owner_of):
    # A call admitted from the lease at its last moment counts a whole window from then: so
    # does the lease, and not a moment less.
    async def body(owner: LeaseOwner, key: str) -> None:
        spec = LimitSpec(rpm=32, tpm=3200)
        lease = await owner.lease(key, spec, 2, 0, 0)
        assert lease is not None and lease.num_requests == 2
        granted = time.monotonic()
        while time.monotonic() - granted < 0.5:  # past a window from the grant, not from its end
            assert (await remaining(owner, key, spec))[0] == 30
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.15)
        assert (await remaining(owner, key, spec))[0] == 32
        await owner.settle_lease(lease, 1, 0)  # gone from the window: nothing to settle
        assert (await remaining(owner, key, spec))[0] == 32

    run_owner(owner_of, body, window_s=0.4, lease_s=0.2)


def test_a_refusal_waits_for_the_lease_to_leave_the_window(owner_of):
    async def body(owner: LeaseOwner, key: str) -> None:
        spec = LimitSpec(rpm=16, tpm=160)
        assert await owner.lease(key, spec, 1, 10, 0) is not None
        for _ in range(15):
            assert (await owner.admit(key, spec, 1)).allowed
        refused = await owner.admit(key, spec, 1)
        assert not refused.allowed and refused.limit_kind == "requests"
        # The oldest of the 16 is the first admission (now), not the lease (now + 2 s).
        assert refused.retry_after_s is not None and 9 < refused.retry_after_s <= 10
        # Tokens: the lease's 10 leave last, at now + 2 s + the window.
        too_many = await owner.admit(key, LimitSpec(tpm=160), 160)  # all 25 in the window must leave
        assert not too_many.allowed and too_many.retry_after_s is not None and 11 < too_many.retry_after_s <= 12
        reset = (await owner.headers(key, spec))["x-ratelimit-reset-requests"]
        assert reset.endswith("s") and 11 < float(reset[:-1]) <= 12  # the lease's, not the first admission's

        # A lease of many requests: a refusal waits until enough of them, with the lease, have left.
        many = key + "-many"
        lease = await owner.lease(many, LimitSpec(rpm=160), 10, 0, 0)
        assert lease is not None and lease.num_requests == 10
        for _ in range(150):
            assert (await owner.admit(many, LimitSpec(rpm=160), 0)).allowed
        refused = await owner.admit(many, LimitSpec(rpm=160), 0)
        assert not refused.allowed and refused.retry_after_s is not None and 9 < refused.retry_after_s <= 10
        await owner.settle_lease(lease, 0, 0)  # its calls used none: 10 requests free again
        assert (await owner.admit(many, LimitSpec(rpm=160), 0)).allowed

    run_owner(owner_of, body, window_s=10, lease_s=2)


def test_leases_and_calls_at_random_never_pass_a_limit(owner_of):
    """Any mix of leases, calls, settlements: the window never counts more than the limits, and
    never fewer than what was admitted."""
    async def body(owner: LeaseOwner, key: str) -> None:
        rng = random.Random(7)
        spec = LimitSpec(rpm=200, tpm=5000)
        admitted_requests = admitted_tokens = 0
        leases_out = []
        for _ in range(1000):
            roll = rng.random()
            if roll < 0.4:
                tokens = rng.randrange(0, 60)
                if (await owner.admit(key, spec, tokens)).allowed:
                    admitted_requests, admitted_tokens = admitted_requests + 1, admitted_tokens + tokens
            elif roll < 0.7:
                lease = await owner.lease(key, spec, rng.randrange(1, 30), 400, rng.randrange(0, 40))
                if lease is not None:
                    leases_out.append([lease, 0, 0])
            elif leases_out:
                held = rng.choice(leases_out)
                lease, used_requests, used_tokens = held
                if used_requests < lease.num_requests:
                    tokens = rng.randrange(0, 30)
                    if used_tokens + tokens <= lease.num_tokens:  # the gateway admits from it
                        held[1], held[2] = used_requests + 1, used_tokens + tokens
                        admitted_requests, admitted_tokens = admitted_requests + 1, admitted_tokens + tokens
                if rng.random() < 0.3:  # the lease ends: settled to what it holds
                    await owner.settle_lease(lease, held[1], held[2])
                    leases_out.remove(held)
            left_requests, left_tokens = await remaining(owner, key, spec)
            assert admitted_requests <= 200 - left_requests <= 200 and admitted_tokens <= 5000 - left_tokens <= 5000
        assert admitted_requests > 150  # the key's limit was reached, and used

    run_owner(owner_of, body, window_s=3600, lease_s=1)


def test_redis_leases_leave_with_the_window_and_keep_the_sums(redis_url):
    """In Redis a lease's extra requests are a hash and a sum beside the window: both go with it."""
    from redis.asyncio import Redis

    from tokenway.gateway.limits_redis import RedisLimiter

    async def main() -> None:
        owner, client = RedisLimiter(redis_url, window_s=0.3, lease_s=0.1), Redis.from_url(redis_url)
        key = f"lease-{uuid.uuid4().hex[:12]}"
        spec = LimitSpec(rpm=1600, tpm=160_000, tpd=10**6)
        try:
            for _ in range(3):
                assert await owner.lease(key, spec, 50, 1000, 1) is not None
            assert (await owner.admit(key, spec, 10)).allowed
            win, tok, _, _, _, _, total, req = owner.keys(key)
            assert await client.zcard(win) == 4 and int(await client.hget(total, "req")) == 3 * 49
            assert await remaining(owner, key, spec) == (1600 - 151, 160_000 - 3010)
            await asyncio.sleep(0.5)  # the window and the leases' last moments are past
            assert await remaining(owner, key, spec) == (1600, 160_000)
            assert await client.hlen(req) == 0 and await client.hlen(tok) == 0
            assert int(await client.hget(total, "req")) == 0 and int(await client.hget(total, "tok")) == 0
            # The day still counts the leases' tokens (and the call's): 3,010 of it.
            refused = await owner.admit(key, LimitSpec(tpd=3010 + 10), 11)
            assert not refused.allowed and refused.limit_kind == "tokens_per_day"
        finally:
            await owner.close()
            await client.aclose()

    asyncio.run(main())


# ---- Gateways on one Redis. ----

def test_rpm_and_tokens_are_exact_across_gateways_leasing_from_one_redis(redis_url):
    from tokenway.gateway.limits_redis import RedisLimiter

    async def main() -> None:
        gateways = [LeasedLimiter(RedisLimiter(redis_url)) for _ in range(4)]
        owner = gateways[0].remote
        key = f"lease-{uuid.uuid4().hex[:12]}"
        try:
            spec = LimitSpec(rpm=64)
            decisions = await asyncio.gather(*(gateways[i % 4].admit(key, spec, 3) for i in range(200)))
            assert sum(d.allowed for d in decisions) == 64  # no more, and none of the limit left unused
            assert {d.limit_kind for d in decisions if not d.allowed} == {"requests"}
            assert (await owner.headers(key, spec))["x-ratelimit-remaining-requests"] == "0"

            tokens_key, tokens = key + "-tokens", LimitSpec(tpm=1600)
            decisions = await asyncio.gather(*(gateways[i % 3].admit(tokens_key, tokens, 20) for i in range(120)))
            admitted = [(i % 3, d) for i, d in enumerate(decisions) if d.allowed]
            assert len(admitted) == 80
            for gateway, d in admitted:  # each used 5 of its 20: the 15 come back
                assert d.reservation is not None
                await gateways[gateway].reconcile(d.reservation, 5)
        finally:
            for gateway in gateways:
                await gateway.close()  # settles its leases
        checker = RedisLimiter(redis_url)
        try:
            headers = await checker.headers(tokens_key, tokens)
            assert headers["x-ratelimit-remaining-tokens"] == str(1600 - 80 * 5)
        finally:
            await checker.close()

    asyncio.run(main())


def test_a_gateway_asks_redis_about_once_a_lease_not_once_a_call(redis_url):
    from tokenway.gateway.limits_redis import RedisLimiter

    class Counting(RedisLimiter):
        asked: list[str] = []

        async def _run(self, key_id: str, args: list, share: bool = False) -> list:
            self.asked.append(args[0])
            return await super()._run(key_id, args, share)

    async def main() -> None:
        gateway = LeasedLimiter(Counting(redis_url))
        key = f"lease-{uuid.uuid4().hex[:12]}"
        spec = LimitSpec(rpm=10**6, tpm=10**9)
        try:
            for _ in range(10):
                results = await asyncio.gather(*(gateway.admit(key, spec, 40) for _ in range(100)))
                assert all(d.allowed for d in results)
                for d in results:
                    assert d.reservation is not None
                    await gateway.reconcile(d.reservation, 10)
            assert Counting.asked.count("lease") < 15 and "admit" not in Counting.asked
        finally:
            await gateway.close()
        checker = RedisLimiter(redis_url)
        try:
            assert await remaining(checker, key, spec) == (10**6 - 1000, 10**9 - 1000 * 10)
        finally:
            await checker.close()

    asyncio.run(main())


def test_a_redis_that_is_down_is_limits_unavailable_at_once():
    """One wait for the ask, not one more for the call: every call waiting on it goes by the policy."""
    from tokenway.gateway.limits_redis import RedisLimiter

    async def main() -> None:
        gateway = LeasedLimiter(RedisLimiter("redis://127.0.0.1:1/0", timeout_s=0.5))
        started = time.monotonic()
        results = await asyncio.gather(*(gateway.admit("k", LimitSpec(rpm=1000), 0) for _ in range(5)),
                                       return_exceptions=True)
        assert all(isinstance(result, LimitsUnavailable) for result in results)
        assert time.monotonic() - started < 1.5
        await gateway.close()

    asyncio.run(main())


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


@pytest.fixture(params=["memory", "redis"])
def budget_owner_of(request):
    """A budget lease owner's factory, called inside the test's loop (its seed: nothing spent)."""
    if request.param == "memory":
        return lambda: InProcessBudgets(no_spend)
    from tokenway.gateway.budgets_redis import RedisBudgets

    redis_url = request.getfixturevalue("redis_url")
    return lambda: RedisBudgets(redis_url, no_spend)


def test_a_budget_lease_is_a_hold_settled_in_steps(budget_owner_of):
    async def main() -> None:
        owner, key = budget_owner_of(), f"lease-{uuid.uuid4().hex[:12]}"
        try:
            budget = 16 * 10**6
            if isinstance(owner, InProcessBudgets):  # it cannot await the ledger in line: its first call seeds
                assert await owner.lease(key, budget, 10**6, 1) is None
            await owner.reserve(key, budget, 0)  # seeds it (Redis: so does a lease)
            lease = await owner.lease(key, budget, 10**9, 1)
            assert lease is not None and lease.nanos == budget // LEASE_PART
            assert (lease.spent_nanos, lease.held_nanos) == (0, 0)
            assert await owner.state(key) == BudgetState(0, 10**6)
            await owner.settle_lease(lease, 300, 200)  # 300 spent, 200 still held by calls
            assert await owner.state(key) == BudgetState(300, 200)
            await owner.settle_lease(lease, 150, 0)
            assert await owner.state(key) == BudgetState(450, 0)
            await owner.settle_lease(lease, 10, 0)  # a step after the last: still owed
            assert await owner.state(key) == BudgetState(460, 0)
            # Only what is free now, and never below the call's own worst case.
            assert await owner.lease(key, budget, budget, budget) is None  # more than its part
            await owner.reserve(key, budget, budget - 460 - 10)
            small = await owner.lease(key, budget, 10**6, 5)
            assert small is not None and small.nanos == 10 and small.held_nanos == budget - 470
            assert await owner.lease(key, budget, 10**6, 1) is None  # nothing left
            with pytest.raises(ValueError):
                await owner.lease(key, budget, 10, 11)
            with pytest.raises(ValueError):
                await owner.settle_lease(small, -1, 0)
        finally:
            await owner.close()

    asyncio.run(main())


def test_a_redis_budget_lease_seeds_a_key_redis_has_not_seen(redis_url):
    from tokenway.gateway.budgets_redis import RedisBudgets

    async def spent_before(key_id: str) -> float:
        return 0.004  # what the ledger holds for the key: 4,000,000 nanos

    async def main() -> None:
        owner, key = RedisBudgets(redis_url, spent_before), f"lease-{uuid.uuid4().hex[:12]}"
        try:
            lease = await owner.lease(key, 16 * 10**6, 10**6, 1)
            assert lease is not None and (lease.nanos, lease.spent_nanos) == (10**6, 4 * 10**6)
            assert await owner.state(key) == BudgetState(4 * 10**6, 10**6)
        finally:
            await owner.close()

    asyncio.run(main())


def test_a_redis_budget_lease_step_for_a_state_seeded_anew_is_dropped(redis_url):
    """As a call's settle is: the new seed read the ledger, where the lease's calls' rows were."""
    from redis.asyncio import Redis

    from tokenway.gateway.budgets_redis import RedisBudgets

    async def main() -> None:
        owner, client = RedisBudgets(redis_url, no_spend), Redis.from_url(redis_url)
        key = f"lease-{uuid.uuid4().hex[:12]}"
        try:
            await owner.reserve(key, 16 * 10**6, 0)
            lease = await owner.lease(key, 16 * 10**6, 10**6, 1)
            assert lease is not None and lease.epoch
            await client.delete(*owner.keys(key))  # the state is lost (a restart, say)
            await owner.reserve(key, 16 * 10**6, 0)  # ... and seeded again
            await owner.settle_lease(lease, 500, 0)
            assert await owner.state(key) == BudgetState(0, 0)
        finally:
            await owner.close()
            await client.aclose()

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

        async def settle_lease(self, lease: BudgetLease, cost_nanos: int, held_nanos: int) -> None:
            if self.failures:
                self.failures -= 1
                raise LimitsUnavailable("the owner's socket is gone")
            await super().settle_lease(lease, cost_nanos, held_nanos)

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


# ---- Budgeted calls through gatekeepers on one Redis, both stores leased. ----

MODEL = "m"
CALL_NANOS = 30_000_000  # 10 prompt tokens and max_tokens 10 at the price below: $0.03


def leased_gate(tmp_path, redis_url: str, seed):
    from tokenway.billing.ledger import Ledger
    from tokenway.billing.pricing import ModelPrice, PriceTable
    from tokenway.gateway.budgets import make_budgets
    from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
    from tokenway.gateway.keystore import KeyStore
    from tokenway.gateway.limits import make_limiter

    name = uuid.uuid4().hex
    gate = Gatekeeper(KeyStore(tmp_path / f"{name}.keys.db"), make_limiter(redis_url),
                      Ledger(f"sqlite:///{tmp_path / f'{name}.ledger.db'}"),
                      PriceTable({MODEL: ModelPrice(input=1000.0, output=2000.0)}), Defaults(), host="127.0.0.1",
                      budgets=make_budgets(redis_url, seed))
    assert isinstance(gate.joint, leases.LeasedJoint)  # the production wiring on a Redis
    return gate


async def admit_or_refusal(gate, caller):
    from tokenway.protocol.errors import RateLimitError

    try:
        return await gate.admit(caller, MODEL, 10, 10)
    except RateLimitError as exc:
        return exc


def test_budgeted_calls_through_two_leasing_gateways_never_pass_the_budget_and_spend_exactly(tmp_path, redis_url):
    from tokenway.gateway.auth import Principal
    from tokenway.gateway.budgets_redis import RedisBudgets
    from tokenway.gateway.call import CallOutcome

    async def main() -> None:
        caller = Principal(key_id=f"lease-{uuid.uuid4().hex[:12]}", name="k", budget_usd=2.0, rpm=10_000)
        gates = [leased_gate(tmp_path, redis_url, no_spend) for _ in range(2)]
        try:
            admitted = []
            for _ in range(3):  # a burst a round; each call then settles at $0.02, in line where it was leased
                outcomes = await asyncio.gather(*(admit_or_refusal(gates[i % 2], caller) for i in range(40)))
                for i, outcome in enumerate(outcomes):
                    if not isinstance(outcome, Exception):
                        admitted.append(outcome)
                        gates[i % 2]._settle(outcome, CallOutcome(200, prompt_tokens=10, completion_tokens=5), 0.02)
                await asyncio.sleep(3 * leases.SETTLE_EVERY_S)  # ended leases' settlements reach Redis
            # $2 is 100 calls' cost, each admitted on its worst case ($0.03) until it settles; the
            # leases out (1/16 of the budget each, a gateway) may leave a little unused.
            assert 75 <= len(admitted) <= 100
            assert all(a.decision is not None and a.decision.allowed for a in admitted)
            for _ in range(3):  # the calls asked of Redis settle in the background
                await asyncio.sleep(0.05)
        finally:
            for gate in gates:
                await gate.close()  # the leases' last settlements
        checker = RedisBudgets(redis_url, no_spend)
        try:
            state = await checker.state(caller.key_id)
            assert state == BudgetState(len(admitted) * 20_000_000, 0)  # every call's cost, nothing held
        finally:
            await checker.close()

    asyncio.run(main())


def test_a_budgeted_call_the_limits_refuse_gives_its_budget_lease_back(tmp_path, redis_url):
    from tokenway.gateway.auth import Principal
    from tokenway.gateway.budgets_redis import RedisBudgets

    async def main() -> None:
        caller = Principal(key_id=f"lease-{uuid.uuid4().hex[:12]}", name="k", budget_usd=100.0, rpm=32)
        gate = leased_gate(tmp_path, redis_url, no_spend)
        try:
            outcomes = [await admit_or_refusal(gate, caller) for _ in range(40)]
            admitted = [o for o in outcomes if not isinstance(o, Exception)]
            refused = [o for o in outcomes if isinstance(o, Exception)]
            assert len(admitted) == 32 and {o.limit_kind for o in refused} == {"requests"}
            assert sum(a.budget.epoch == leases.BUDGET_EPOCH for a in admitted) >= 30  # from leases
        finally:
            await gate.close()  # the leases settle to what their calls (still in flight) hold
        checker = RedisBudgets(redis_url, no_spend)
        try:  # the admitted calls' worst cases, none of the refused ones'
            assert await checker.state(caller.key_id) == BudgetState(0, 32 * CALL_NANOS)
        finally:
            await checker.close()

    asyncio.run(main())


def test_a_leasing_gateway_asks_redis_about_once_a_lease_for_budgeted_calls(tmp_path, redis_url):
    from tokenway.gateway.auth import Principal
    from tokenway.gateway.call import CallOutcome

    async def main() -> None:
        caller = Principal(key_id=f"lease-{uuid.uuid4().hex[:12]}", name="k", budget_usd=10_000.0,
                           rpm=10**6, tpm=10**9)
        gate = leased_gate(tmp_path, redis_url, no_spend)
        asked: list[str] = []
        for store in (gate.limiter.remote, gate.budgets.remote):
            run = store._run
            store._run = lambda key_id, args, *rest, run=run: asked.append(args[0]) or run(key_id, args, *rest)
        joint = gate.joint.joint
        joint_admit = joint.admit
        joint.admit = lambda *args, **kwargs: asked.append("joint") or joint_admit(*args, **kwargs)
        try:
            for _ in range(5):
                outcomes = await asyncio.gather(*(admit_or_refusal(gate, caller) for _ in range(100)))
                assert not any(isinstance(o, Exception) for o in outcomes)
                for admission in outcomes:
                    gate._settle(admission, CallOutcome(200, prompt_tokens=10, completion_tokens=5), 0.02)
            # The key's first call went by the one script (it seeds the budget), the rest by leases.
            assert asked.count("joint") == 1 and "admit" not in asked and "reserve" not in asked
            assert 2 <= asked.count("lease") < 30, asked
        finally:
            await gate.close()

    asyncio.run(main())
