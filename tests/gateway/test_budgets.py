"""Budgets by reservation, on both backends (in process, and a real Redis through
scripts/redis.sh), in exact nano-dollars; and what the Gatekeeper tells a call its budget refuses."""

from __future__ import annotations

import asyncio
import functools
import random
import socket
import uuid
from collections import Counter

import pytest
import redis.asyncio as aioredis

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import ModelPrice, PriceTable, cost_usd
from tokenway.gateway.auth import Principal
from tokenway.gateway.budgets import (
    BudgetStore,
    InProcessBudgets,
    SeedUnavailable,
    format_usd,
    make_budgets,
    nanos_down,
    nanos_up,
)
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper, max_tokens_within
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter, LimitsUnavailable
from tokenway.protocol.errors import RateLimitError


class Seed:
    """The ledger's spend_usd as a budget store sees it, counting how often each key is asked."""

    def __init__(self, key_to_usd: dict[str, float] | None = None, error: Exception | None = None) -> None:
        self.key_to_usd = key_to_usd or {}
        self.error = error
        self.num_calls: Counter[str] = Counter()

    async def __call__(self, key_id: str) -> float:
        self.num_calls[key_id] += 1
        await asyncio.sleep(0)  # a real seed awaits the ledger: let concurrent callers interleave
        if self.error is not None:
            raise self.error
        return self.key_to_usd.get(key_id, 0.0)


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    """A store factory (seed, **options), called inside the test's event loop."""
    if request.param == "memory":
        return InProcessBudgets
    from tokenway.gateway.budgets_redis import RedisBudgets

    return functools.partial(RedisBudgets, request.getfixturevalue("redis_url"))


def run(body):
    return asyncio.run(body())


def new_key() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"  # a Redis may outlive a run: never reuse a key


def test_amounts_are_exact_nanos_costs_rounded_up_budgets_down():
    assert nanos_up(0.0015) == 1_500_000  # 0.0015 * 1e9 is 1499999.9999999998 in floats
    assert nanos_up(30 * 1000 / 1e6) == 30_000_000
    assert nanos_up(1e-10) == 1 and nanos_up(0.0) == 0
    assert nanos_down(0.5) == 500_000_000 and nanos_down(1.0000000009) == 1_000_000_000
    assert nanos_up(2.5e-9) == 3 and nanos_down(2.5e-9) == 2
    for bad in (-0.01, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            nanos_up(bad)
    assert [format_usd(n) for n in (0, 500_000_000, 34_000_000, 123_000, 1_234_567_890_000)] == [
        "$0.00", "$0.50", "$0.034", "$0.000123", "$1,234.56789"]


def test_seeded_once_from_the_ledger_then_counted_by_the_store(backend):
    async def body():
        key, seed = new_key(), Seed()
        seed.key_to_usd[key] = 0.1
        store: BudgetStore = backend(seed)
        try:
            assert await store.state(key) is None  # not seeded by a look
            first = await store.reserve(key, 500_000_000, 200_000_000)
            assert first.allowed and (first.spent_nanos, first.held_nanos) == (100_000_000, 0)
            assert first.reservation.reserved_nanos == 200_000_000
            state = await store.state(key)
            assert (state.spent_nanos, state.held_nanos) == (100_000_000, 200_000_000)
            await store.settle(first.reservation, 150_000_000)
            state = await store.state(key)
            assert (state.spent_nanos, state.held_nanos) == (250_000_000, 0)
            seed.key_to_usd[key] = 9.0  # the ledger moved on: the store's own total stands
            second = await store.reserve(key, 500_000_000, 250_000_000)
            assert second.allowed and second.spent_nanos == 250_000_000
            assert seed.num_calls[key] == 1
        finally:
            await store.close()

    run(body)


def test_admits_while_spent_plus_held_fits_to_the_nano(backend):
    async def body():
        key, store = new_key(), backend(Seed())
        try:
            held = [await store.reserve(key, 1000, 300) for _ in range(3)]
            assert all(d.allowed for d in held) and [d.held_nanos for d in held] == [0, 300, 600]
            refused = await store.reserve(key, 1000, 300)
            assert not refused.allowed and (refused.spent_nanos, refused.held_nanos) == (0, 900)
            await store.settle(held[0].reservation, 100)  # 100 spent + 600 held: 300 more fits exactly
            assert (await store.reserve(key, 1000, 300)).allowed
            assert not (await store.reserve(key, 1000, 1)).allowed
            state = await store.state(key)
            assert (state.spent_nanos, state.held_nanos) == (100, 900)
        finally:
            await store.close()

    run(body)


def test_concurrent_reservations_never_overshoot(backend):
    async def body():
        key, seed = new_key(), Seed()
        # Two stores on one Redis are two gateways; in process, one store shared.
        stores = [backend(seed), backend(seed)] if backend is not InProcessBudgets else [backend(seed)]
        try:
            decisions = await asyncio.gather(*(stores[i % len(stores)].reserve(key, 100, 7) for i in range(50)))
            admitted = [d for d in decisions if d.allowed]
            assert len(admitted) == 14  # 14 * 7 = 98 <= 100 < 15 * 7
            state = await stores[0].state(key)
            assert (state.spent_nanos, state.held_nanos) == (0, 98)
            await asyncio.gather(*(stores[0].settle(d.reservation, 5) for d in admitted))
            state = await stores[-1].state(key)
            assert (state.spent_nanos, state.held_nanos) == (70, 0)
            if len(stores) == 1:  # one read for the burst (gateways on one Redis: the first seed stands)
                assert seed.num_calls[key] == 1
        finally:
            for store in stores:
                await store.close()

    run(body)


def test_a_call_refused_after_admission_settles_to_nothing(backend):
    async def body():
        key, store = new_key(), backend(Seed({}))
        try:
            decision = await store.reserve(key, 1000, 1000)
            await store.settle(decision.reservation, 0)
            state = await store.state(key)
            assert (state.spent_nanos, state.held_nanos) == (0, 0)
            assert (await store.reserve(key, 1000, 1000)).allowed
        finally:
            await store.close()

    run(body)


def test_an_expired_reservation_gives_its_hold_back_and_its_cost_still_counts(backend):
    async def body():
        key, store = new_key(), backend(Seed(), reservation_ttl_s=0.2)
        try:
            decision = await store.reserve(key, 1000, 600)
            assert not (await store.reserve(key, 1000, 600)).allowed
            await asyncio.sleep(0.3)
            assert (await store.state(key)).held_nanos == 0
            await store.settle(decision.reservation, 250)  # the gateway was slow, not dead: it is owed
            state = await store.state(key)
            assert (state.spent_nanos, state.held_nanos) == (250, 0)
            assert not (await store.reserve(key, 1000, 751)).allowed
            assert (await store.reserve(key, 1000, 750)).allowed
        finally:
            await store.close()

    run(body)


def test_a_seed_the_ledger_cannot_give_is_seed_unavailable(backend):
    async def body():
        store = backend(Seed(error=OSError("connection refused")))
        try:
            with pytest.raises(SeedUnavailable, match="cannot seed"):
                await store.reserve(new_key(), 1000, 10)
        finally:
            await store.close()

    run(body)


def test_redis_state_lost_is_seeded_again_and_its_old_settles_dropped(redis_url):
    from tokenway.gateway.budgets_redis import RedisBudgets

    async def body():
        key, seed = new_key(), Seed()
        store = RedisBudgets(redis_url, seed)
        client = aioredis.Redis.from_url(redis_url)
        try:
            seed.key_to_usd[key] = 0.000001  # 1000 nanos
            old = await store.reserve(key, 10_000, 4000)
            await client.delete(*store.keys(key))  # as a Redis restart would
            seed.key_to_usd[key] = 0.000003  # the ledger holds the old call's row by now
            new = await store.reserve(key, 10_000, 2000)
            assert new.allowed and new.spent_nanos == 3000 and new.reservation.epoch != old.reservation.epoch
            await store.settle(old.reservation, 2000)  # counted by the new seed already
            state = await store.state(key)
            assert (state.spent_nanos, state.held_nanos) == (3000, 2000)
            assert seed.num_calls[key] == 2
            ttl_ms = [await client.pttl(name) for name in store.keys(key)]
            assert all(86_000_000 < ttl <= 86_400_000 for ttl in ttl_ms), ttl_ms  # expiring together
        finally:
            await client.aclose()
            await store.close()

    run(body)


def test_a_dead_redis_is_limits_unavailable_on_every_call():
    from tokenway.gateway.budgets_redis import RedisBudgets

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed

    async def body():
        store = RedisBudgets(f"redis://user:secret@127.0.0.1:{port}/0", Seed())
        try:
            for call in (store.reserve("k", 10, 1), store.state("k")):
                with pytest.raises(LimitsUnavailable) as info:
                    await call
                assert f"127.0.0.1:{port}" in str(info.value) and "secret" not in str(info.value)
        finally:
            await store.close()

    run(body)


def test_make_budgets_checks_its_url(redis_url):
    assert isinstance(make_budgets("memory", Seed()), InProcessBudgets)
    with pytest.raises(ValueError, match="redis://"):
        make_budgets("http://example.com", Seed())


# ---- the Gatekeeper: what a call reserves, and what a refused one is told ----------------------

MODEL = "m"
PRICE = ModelPrice(input=1000.0, output=2000.0)  # a prompt token $0.001, a completion token $0.002


@pytest.fixture()
def gatekeeper(tmp_path):
    def make():
        ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
        return Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger,
                          PriceTable({MODEL: PRICE}), Defaults(), host="127.0.0.1")

    return make


def principal(budget_usd: float) -> Principal:
    return Principal(key_id=new_key(), name="budgeted", budget_usd=budget_usd)


def test_the_worst_case_is_reserved_and_max_tokens_that_fits_is_said(gatekeeper):
    async def body():
        gate = gatekeeper()
        try:
            caller = principal(0.060)
            # 10 prompt tokens ($0.010) and 2 choices: 12 tokens each fit ($0.048), 13 do not ($0.052).
            assert max_tokens_within(PRICE, 10, 2, nanos_down(0.060)) == 12
            with pytest.raises(RateLimitError) as info:
                await gate.admit(caller, MODEL, 10, 13 * 2, n=2)
            error = info.value
            assert error.code == "insufficient_quota" and error.limit_kind == "budget" and error.retry_after is None
            assert error.message == (
                "This request may cost up to $0.062 (its prompt and max_tokens at the model's price, the prompt "
                "uncached), more than the $0.06 that remains of this API key's $0.06 budget; lower max_tokens to "
                "12 or less.")
            admission = await gate.admit(caller, MODEL, 10, 12 * 2, n=2)
            assert admission.budget.reserved_nanos == nanos_up(cost_usd(PRICE, 10, 0, 24)) == 58_000_000
            # The rest is held by that call in flight: a retry may pass once it ends.
            with pytest.raises(RateLimitError) as info:
                await gate.admit(caller, MODEL, 3, 0)  # $0.003 more: $0.061
            assert info.value.retry_after == 1.0 and "$0.058 is held by its calls in flight" in info.value.message
        finally:
            await gate.close()

    run(body)


def test_max_tokens_within_is_the_largest_that_fits():
    rng = random.Random(0)
    for _ in range(500):
        price = ModelPrice(input=rng.choice([0.0, 0.15, 2.5, 1000.0]), output=rng.choice([0.075, 0.6, 10.0, 2000.0]))
        num_prompt_tokens, n, left = rng.randrange(5000), rng.randrange(1, 4), rng.randrange(1, 10**9)

        def cost(max_tokens: int, price=price, num_prompt_tokens=num_prompt_tokens, n=n) -> int:
            return nanos_up(cost_usd(price, num_prompt_tokens, 0, max_tokens * n))

        best = max_tokens_within(price, num_prompt_tokens, n, left)
        assert cost(best + 1) > left and (cost(best) <= left if best else cost(1) > left)


def test_a_spent_budget_and_a_prompt_that_alone_does_not_fit(gatekeeper):
    async def body():
        gate = gatekeeper()
        try:
            caller = principal(0.005)
            with pytest.raises(RateLimitError) as info:
                await gate.admit(caller, MODEL, 6, 0)  # $0.006 of prompt: no max_tokens would help
            assert info.value.message.endswith("more than the $0.005 that remains of this API key's $0.005 budget.")
            admission = await gate.admit(caller, MODEL, 5, 0)
            await gate.budgets.settle(admission.budget, admission.budget.reserved_nanos)
            with pytest.raises(RateLimitError) as info:
                await gate.admit(caller, MODEL, 0, 0)  # even a free call: nothing remains
            assert info.value.message == "This API key has used its budget: $0.005 of $0.005 spent, nothing remains."
            assert info.value.retry_after is None
        finally:
            await gate.close()

    run(body)


def test_a_call_the_limiter_refuses_gives_its_budget_reservation_back(gatekeeper):
    async def body():
        gate = gatekeeper()
        try:
            caller = Principal(key_id=new_key(), name="both", budget_usd=1.0, rpm=1)
            first = await gate.admit(caller, MODEL, 10, 10)
            with pytest.raises(RateLimitError) as info:
                await gate.admit(caller, MODEL, 10, 10)
            assert info.value.limit_kind == "requests"
            await asyncio.sleep(0.01)  # the release runs in the background
            state = await gate.budgets.state(caller.key_id)
            assert (state.spent_nanos, state.held_nanos) == (0, first.budget.reserved_nanos)
        finally:
            await gate.close()

    run(body)
