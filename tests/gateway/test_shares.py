"""A key's batch share (gateway/shares.py) in the limits, on both backends (in process, and a
real Redis through scripts/redis.sh): a call with a share counts against the key's limits and
the share's, held by both or by neither, exactly under concurrency."""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenway.gateway.budgets import BudgetState, BudgetStore, InProcessBudgets
from tokenway.gateway.gatekeeper import Defaults
from tokenway.gateway.limits import Limiter, LimitSpec
from tokenway.gateway.shares import BatchShare
from tokenway.protocol.errors import FieldError

from .test_budgets import Seed
from .test_limits import backend, new_key, run  # noqa: F401 - backend is a fixture

KEY = LimitSpec(rpm=10, tpm=2000, max_concurrent=8)
SHARE = LimitSpec(rpm=5, tpm=1000, max_concurrent=4)


def test_a_share_admits_its_part_and_leaves_the_rest_to_the_key(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key, spec, share = new_key(), LimitSpec(rpm=10), LimitSpec(rpm=5)
        batch = [await limiter.admit(key, spec, 10, share) for _ in range(5)]
        assert all(d.allowed and d.reservation.in_share for d in batch)
        refused = await limiter.admit(key, spec, 10, share)
        assert (refused.allowed, refused.limit_kind, refused.by_share) == (False, "requests", True)
        assert 0 < refused.retry_after_s <= 60 and "retry-after" in refused.headers
        assert refused.headers["x-ratelimit-remaining-requests"] == "5"  # the key's own window
        interactive = [await limiter.admit(key, spec, 10) for _ in range(5)]
        assert all(d.allowed and not d.reservation.in_share for d in interactive)
        refused = await limiter.admit(key, spec, 10)
        assert (refused.limit_kind, refused.by_share) == ("requests", False)

    run(backend, body)


def test_a_share_is_reconciled_in_both_and_once(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key = new_key()
        first = await limiter.admit(key, KEY, 600, SHARE)
        assert first.allowed
        refused = await limiter.admit(key, KEY, 600, SHARE)  # 1200 > the share's 1000
        assert (refused.limit_kind, refused.by_share) == ("tokens", True)
        await limiter.reconcile(first.reservation, 100)
        await limiter.reconcile(first.reservation, 0)  # a second reconcile changes nothing
        second = await limiter.admit(key, KEY, 900, SHARE)  # 100 + 900 fit the share now
        assert second.allowed and second.headers["x-ratelimit-remaining-tokens"] == "1000"
        assert (await limiter.admit(key, KEY, 1, SHARE)).by_share
        assert (await limiter.admit(key, KEY, 1000)).allowed  # the key's other calls: the rest, exactly
        assert not (await limiter.admit(key, KEY, 1)).allowed

    run(backend, body)


def test_a_call_larger_than_the_share_is_refused_without_a_retry(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key = new_key()
        refused = await limiter.admit(key, KEY, 1001, SHARE)
        assert (refused.allowed, refused.limit_kind, refused.by_share, refused.retry_after_s) == (
            False, "tokens", True, None)
        assert (await limiter.admit(key, KEY, 1000, SHARE)).allowed  # the refusal held nothing

    run(backend, body)


def test_a_share_slots_are_its_own_and_the_keys(backend):  # noqa: F811
    async def body(limiter: Limiter):
        key = new_key()
        held = [await limiter.admit(key, KEY, 1, SHARE) for _ in range(4)]
        refused = await limiter.admit(key, KEY, 1, SHARE)
        assert (refused.limit_kind, refused.by_share, refused.retry_after_s) == ("concurrency", True, 1.0)
        others = [await limiter.admit(key, KEY, 1) for _ in range(4)]
        assert all(d.allowed for d in held + others)
        assert (await limiter.admit(key, KEY, 1)).limit_kind == "concurrency"
        await limiter.reconcile(held[0].reservation, 1)  # frees a slot in the share and in the key
        assert (await limiter.admit(key, KEY, 1, SHARE)).allowed

    run(backend, body)


@pytest.mark.parametrize("seed", [1, 2])
def test_shared_and_unshared_calls_at_once_never_pass_either_limit(backend, seed):  # noqa: F811
    rng = random.Random(seed)

    async def body(limiter: Limiter):
        key = new_key()
        spec, share = LimitSpec(tpm=3000), LimitSpec(tpm=1200)
        rid_to_tokens: dict[str, tuple[bool, int]] = {}  # every admitted call: in the share?, its tokens

        async def client(in_share: bool):
            for _ in range(6):
                reserve = rng.randint(1, 500)
                decision = await limiter.admit(key, spec, reserve, share if in_share else None)
                if not decision.allowed:
                    continue
                rid = decision.reservation.reservation_id
                rid_to_tokens[rid] = (in_share, reserve)
                assert sum(n for _, n in rid_to_tokens.values()) <= spec.tpm
                assert sum(n for s, n in rid_to_tokens.values() if s) <= share.tpm
                await asyncio.sleep(rng.random() * 0.005)
                used = rng.randint(0, reserve)
                rid_to_tokens[rid] = (in_share, used)
                await limiter.reconcile(decision.reservation, used)

        await asyncio.gather(*(client(i % 2 == 0) for i in range(40)))
        in_share = sum(n for s, n in rid_to_tokens.values() if s)
        total = sum(n for _, n in rid_to_tokens.values())
        assert 0 < in_share < total
        assert int((await limiter.headers(key, spec))["x-ratelimit-remaining-tokens"]) == spec.tpm - total
        share_left, key_left = share.tpm - in_share, spec.tpm - total
        fill = min(share_left, key_left)  # exactly what the share may still take
        if fill > 0:
            assert (await limiter.admit(key, spec, fill, share)).allowed
        refused = await limiter.admit(key, spec, 1, share)
        assert not refused.allowed and (share_left == key_left or refused.by_share == (share_left < key_left))

    run(backend, body)


# -- the budget's share ---------------------------------------------------------------------

BUDGET, SHARE_NANOS, CALL = 1000, 400, 100


@pytest.fixture(params=["memory", "redis"])
def budgets_backend(request):
    """A budget store factory (seed, share_seed), called inside the test's event loop."""
    if request.param == "memory":
        return lambda seed, share_seed: InProcessBudgets(seed, share_seed=share_seed)
    from tokenway.gateway.budgets_redis import RedisBudgets

    url = request.getfixturevalue("redis_url")
    return lambda seed, share_seed: RedisBudgets(url, seed, share_seed=share_seed)


def test_a_budget_share_is_seeded_held_and_settled_beside_the_key(budgets_backend):
    async def body():
        key = new_key()
        seed, share_seed = Seed({key: 200e-9}), Seed({key: 100e-9})  # the ledger: 200 nanos, 100 of them batch
        store: BudgetStore = budgets_backend(seed, share_seed)
        try:
            held = [await store.reserve(key, BUDGET, CALL, SHARE_NANOS) for _ in range(4)]
            assert [d.allowed for d in held] == [True, True, True, False]  # 100 + 3 x 100 = the share
            refused = held[-1]
            assert (refused.by_share, refused.spent_nanos, refused.held_nanos) == (True, 100, 300)
            assert held[0].reservation.share_epoch is not None
            others = [await store.reserve(key, BUDGET, CALL) for _ in range(6)]
            assert [d.allowed for d in others] == [True] * 5 + [False]  # 200 + 300 + 5 x 100 = the budget
            assert not others[-1].by_share and others[0].reservation.share_epoch is None
            await store.settle(held[0].reservation, 40)
            assert await store.state(key) == BudgetState(240, 700)
            assert await store.state(key, share=True) == BudgetState(140, 200)
            assert (seed.num_calls[key], share_seed.num_calls[key]) == (1, 1)
            await store.settle(others[0].reservation, 60)  # the key's alone: the share is not touched
            assert await store.state(key, share=True) == BudgetState(140, 200)
            assert (await store.reserve(key, BUDGET, CALL, SHARE_NANOS)).by_share  # 140 + 200 + 100 > 400
            await store.settle(held[1].reservation, 0)  # a line that cost nothing gives its hold back
            assert (await store.reserve(key, BUDGET, CALL, SHARE_NANOS)).allowed  # 140 + 100 + 100
            assert (await store.reserve(key, BUDGET, 61, SHARE_NANOS)).by_share  # 140 + 200 + 61 > 400
            assert await store.state(key) == BudgetState(300, 600)
        finally:
            await store.close()

    asyncio.run(body())


def test_budget_shares_reserved_at_once_never_pass_either_budget(budgets_backend):
    async def body():
        key = new_key()
        store: BudgetStore = budgets_backend(Seed(), Seed())
        try:
            decisions = await asyncio.gather(*(store.reserve(key, BUDGET, CALL, SHARE_NANOS if i % 2 else None)
                                               for i in range(40)))
            in_share = sum(d.allowed for i, d in enumerate(decisions) if i % 2)
            total = sum(d.allowed for d in decisions)
            assert in_share <= SHARE_NANOS // CALL and total == BUDGET // CALL
            assert await store.state(key) == BudgetState(0, total * CALL)
            assert await store.state(key, share=True) == BudgetState(0, in_share * CALL)
        finally:
            await store.close()

    asyncio.run(body())


def test_a_store_without_a_share_seed_takes_no_share():
    async def body():
        store = InProcessBudgets(Seed())
        with pytest.raises(ValueError, match="share_seed"):
            await store.reserve(new_key(), BUDGET, CALL, SHARE_NANOS)

    asyncio.run(body())


def test_batch_share_parts():
    share = BatchShare(0.29)
    assert share.limits(LimitSpec(rpm=100, tpm=1, tpd=None, max_concurrent=7)) == LimitSpec(
        rpm=29, tpm=1, tpd=None, max_concurrent=2)  # never to nothing, and no float noise
    assert share.limits(LimitSpec()) is None and BatchShare(1).limits(LimitSpec(rpm=5)) is None
    assert share.budget_nanos(1000) == 290 and BatchShare(1.0).budget_nanos(1000) is None
    assert share.applies("batch") and not share.applies("flex") and not BatchShare(1).applies("batch")
    for bad in (0, -0.5, 1.5, "half", True, float("nan")):
        with pytest.raises(FieldError, match="batch_limit_share"):
            BatchShare(bad)
    with pytest.raises(FieldError, match="batch_limit_share"):
        Defaults(batch_share=BatchShare(2))


# -- through the Gatekeeper: the limits and the budget at once (joint_redis.py on Redis) --------


@pytest.fixture(params=["memory", "redis"])
def gate(request, tmp_path):
    """A Gatekeeper factory with a price of $0.001 a token, its stores made in the test's loop."""
    from tokenway.billing.ledger import Ledger
    from tokenway.billing.pricing import ModelPrice, PriceTable
    from tokenway.gateway.gatekeeper import Gatekeeper
    from tokenway.gateway.keystore import KeyStore
    from tokenway.gateway.limits import InProcessLimiter

    def make() -> Gatekeeper:
        ledger = Ledger(f"sqlite:///{tmp_path / f'{new_key()}.db'}")
        prices = PriceTable({"m": ModelPrice(input=1000.0, output=1000.0)})
        if request.param == "memory":
            limiter, budgets = InProcessLimiter(), None
        else:
            from tokenway.gateway.budgets_redis import RedisBudgets
            from tokenway.gateway.limits_redis import RedisLimiter

            url = request.getfixturevalue("redis_url")
            limiter, budgets = RedisLimiter(url), RedisBudgets(url, ledger.spend_usd, share_seed=Seed())
        gatekeeper = Gatekeeper(KeyStore(tmp_path / f"{new_key()}.keys.db"), limiter, ledger, prices,
                                Defaults(batch_share=BatchShare(0.25)), "127.0.0.1", budgets=budgets)
        assert (gatekeeper.joint is not None) == (request.param == "redis")
        return gatekeeper

    return make


def test_batch_calls_take_their_share_and_interactive_calls_the_rest(gate):
    from tokenway.gateway.auth import Principal
    from tokenway.protocol.errors import RateLimitError

    async def body():
        gatekeeper = gate()
        caller = Principal(new_key(), "k", rpm=8, budget_usd=1.0)  # a call of 10 tokens: $0.01

        async def admit(tier):
            try:
                return await gatekeeper.admit(caller, "m", 5, 5, service_tier=tier)
            except RateLimitError as exc:
                return exc

        try:
            batch = await asyncio.gather(*(admit("batch") for _ in range(6)))
            refused = [r for r in batch if isinstance(r, RateLimitError)]
            assert len(refused) == 4 and refused[0].retry_after is not None and refused[0].retry_after > 0
            assert refused[0].message.startswith("Rate limit reached for requests in this key's batch share (25%")
            assert refused[0].code == "rate_limit_exceeded_requests"
            interactive = await asyncio.gather(*(admit("default") for _ in range(7)))
            assert sum(not isinstance(r, RateLimitError) for r in interactive) == 6  # 8 - the 2 batch calls
            held = 2 * 5 * 10**6  # two calls at the batch price
            assert await gatekeeper.budgets.state(caller.key_id, share=True) == BudgetState(0, held)

            caller = Principal(new_key(), "budgeted", budget_usd=0.04)  # the share: $0.01; a batch call $0.005
            batch = await asyncio.gather(*(admit("batch") for _ in range(4)))
            refused = [r for r in batch if isinstance(r, RateLimitError)]
            assert len(refused) == 2 and refused[0].code == "insufficient_quota"
            assert "the batch share ($0.01) of this API key's budget" in refused[0].message
            interactive = await asyncio.gather(*(admit("default") for _ in range(4)))  # $0.01 each
            assert sum(not isinstance(r, RateLimitError) for r in interactive) == 3  # $0.04 - the $0.01 held
        finally:
            await gatekeeper.close()

    asyncio.run(body())
