"""A budgeted call's budget and limits as one script (joint_redis.py), through the Gatekeeper on a
real Redis (scripts/redis.sh): held by both or by neither, exactly, across gateways."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import ModelPrice, PriceTable
from tokenway.gateway.auth import Principal
from tokenway.gateway.budgets import InProcessBudgets
from tokenway.gateway.budgets_redis import RedisBudgets
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.joint_redis import RedisJoint
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.gateway.limits_redis import RedisLimiter
from tokenway.protocol.errors import RateLimitError, ServiceUnavailableError

from .test_budgets import Seed

MODEL = "m"
PRICE = ModelPrice(input=1000.0, output=2000.0)  # a prompt token $0.001, a completion token $0.002
CALL_NANOS = 30_000_000  # 10 prompt tokens and max_tokens 10: $0.03


def new_key() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"  # a Redis may outlive a run: never reuse a key


def make_gate(tmp_path, redis_url: str, seed: Seed, on_error: str = "open") -> Gatekeeper:
    name = uuid.uuid4().hex
    gate = Gatekeeper(KeyStore(tmp_path / f"{name}.keys.db"), RedisLimiter(redis_url),
                      Ledger(f"sqlite:///{tmp_path / f'{name}.ledger.db'}"), PriceTable({MODEL: PRICE}), Defaults(),
                      host="127.0.0.1", budgets=RedisBudgets(redis_url, seed), limits_on_error=on_error)
    assert isinstance(gate.joint, RedisJoint)  # else these tests would exercise the stores in turn
    return gate


async def admit(gate: Gatekeeper, caller: Principal, num_prompt_tokens: int = 10, max_tokens: int = 10):
    """The Admission, or the RateLimitError that refused the call."""
    try:
        return await gate.admit(caller, MODEL, num_prompt_tokens, max_tokens)
    except RateLimitError as exc:
        return exc


async def windows(gate: Gatekeeper, caller: Principal) -> tuple[str | None, str | None]:
    """What remains of the key's RPM and TPM (None: no such limit)."""
    headers = await gate.limiter.headers(caller.key_id, gate.limit_spec(caller))
    return headers.get("x-ratelimit-remaining-requests"), headers.get("x-ratelimit-remaining-tokens")


async def budget(gate: Gatekeeper, caller: Principal) -> tuple[int, int]:
    state = await gate.budgets.state(caller.key_id)
    return state.spent_nanos, state.held_nanos


def test_fifty_concurrent_calls_across_two_gateways_spend_the_budget_to_the_nano(tmp_path, redis_url):
    async def body():
        caller = Principal(key_id=new_key(), name="shared", budget_usd=0.5, rpm=1000, tpm=100_000)
        seed = Seed({caller.key_id: 0.08})  # the ledger's: $0.42 left, exactly 14 calls
        gates = [make_gate(tmp_path, redis_url, seed), make_gate(tmp_path, redis_url, seed)]
        try:
            outcomes = await asyncio.gather(*(admit(gates[i % 2], caller) for i in range(50)))
            admitted = [o for o in outcomes if not isinstance(o, RateLimitError)]
            assert len(admitted) == 14
            assert {(o.code, o.limit_kind) for o in outcomes if o not in admitted} == {("insufficient_quota", "budget")}
            assert all(a.budget.reserved_nanos == CALL_NANOS and a.decision.allowed for a in admitted)
            # No refused call holds anything, at once (no release to wait for): 14 in both stores.
            assert await budget(gates[0], caller) == (80_000_000, 14 * CALL_NANOS)
            assert await windows(gates[1], caller) == (str(1000 - 14), str(100_000 - 14 * 20))
            await asyncio.gather(*(gates[i % 2]._settle_stores(a.decision.reservation, 15, a.budget, 20_000_000)
                                   for i, a in enumerate(admitted)))
            assert await budget(gates[1], caller) == (80_000_000 + 14 * 20_000_000, 0)
            assert await windows(gates[0], caller) == (str(1000 - 14), str(100_000 - 14 * 15))
        finally:
            for gate in gates:
                await gate.close()

    asyncio.run(body())


def test_calls_the_limits_refuse_under_contention_hold_no_budget(tmp_path, redis_url):
    async def body():
        caller = Principal(key_id=new_key(), name="both", budget_usd=0.5, rpm=10)  # the budget fits 16
        gates = [make_gate(tmp_path, redis_url, Seed()), make_gate(tmp_path, redis_url, Seed())]
        try:
            outcomes = await asyncio.gather(*(admit(gates[i % 2], caller) for i in range(50)))
            refused = [o for o in outcomes if isinstance(o, RateLimitError)]
            assert len(refused) == 40 and {o.limit_kind for o in refused} == {"requests"}
            assert await budget(gates[0], caller) == (0, 10 * CALL_NANOS)
            assert (await windows(gates[1], caller))[0] == "0"
        finally:
            for gate in gates:
                await gate.close()

    asyncio.run(body())


def test_a_budget_refusal_leaves_the_rpm_and_tpm_windows_unchanged(tmp_path, redis_url):
    async def body():
        gate = make_gate(tmp_path, redis_url, Seed())
        caller = Principal(key_id=new_key(), name="budgeted", budget_usd=0.05, rpm=10, tpm=1000)
        try:
            first = await admit(gate, caller)
            assert first.decision.allowed and first.budget.reserved_nanos == CALL_NANOS
            before = await windows(gate, caller), await budget(gate, caller)
            assert before == (("9", "980"), (0, CALL_NANOS))
            refused = await admit(gate, caller)  # $0.03 more than the $0.02 left
            assert refused.limit_kind == "budget" and refused.retry_after == 1.0
            assert (await windows(gate, caller), await budget(gate, caller)) == before
        finally:
            await gate.close()

    asyncio.run(body())


@pytest.mark.parametrize("spec,num_prompt_tokens,limit_kind", [
    ({"rpm": 1}, 10, "requests"),
    ({"tpm": 25}, 10, "tokens"),
    ({"max_concurrent": 1}, 10, "concurrency"),
    ({"tpm": 1000}, 1000, "tokens"),  # larger than the limit itself: known before the script
])
def test_a_limits_refusal_leaves_the_budget_unchanged(tmp_path, redis_url, spec, num_prompt_tokens, limit_kind):
    async def body():
        gate = make_gate(tmp_path, redis_url, Seed())
        caller = Principal(key_id=new_key(), name="limited", budget_usd=100.0, **spec)
        try:
            assert (await admit(gate, caller)).decision.allowed
            before = await windows(gate, caller)
            refused = await admit(gate, caller, num_prompt_tokens)
            assert isinstance(refused, RateLimitError) and refused.limit_kind == limit_kind
            assert await budget(gate, caller) == (0, CALL_NANOS)  # the first call's hold, and only it
            assert await windows(gate, caller) == before
        finally:
            await gate.close()

    asyncio.run(body())


def test_where_the_budget_and_the_limits_both_refuse_the_call_hears_the_budget(tmp_path, redis_url):
    async def body():
        gate = make_gate(tmp_path, redis_url, Seed())
        caller = Principal(key_id=new_key(), name="both", budget_usd=0.04, rpm=1)
        try:
            assert (await admit(gate, caller)).decision.allowed
            assert (await admit(gate, caller)).limit_kind == "budget"  # as when the budget was asked first
        finally:
            await gate.close()

    asyncio.run(body())


def test_a_state_lost_is_seeded_again_and_the_settle_then_only_reconciles(tmp_path, redis_url):
    async def body():
        caller = Principal(key_id=new_key(), name="lost", budget_usd=1.0, tpm=1000)
        seed = Seed({caller.key_id: 0.1})
        gate = make_gate(tmp_path, redis_url, seed)
        client = aioredis.Redis.from_url(redis_url)
        try:
            old = await admit(gate, caller)
            assert old.budget.reserved_nanos == CALL_NANOS and seed.num_calls[caller.key_id] == 1
            await client.delete(*gate.budgets.keys(caller.key_id))  # as a Redis restart would
            seed.key_to_usd[caller.key_id] = 0.13  # the ledger holds the old call's row by now
            new = await admit(gate, caller)
            assert new.budget.epoch != old.budget.epoch and seed.num_calls[caller.key_id] == 2
            await gate._settle_stores(old.decision.reservation, 5, old.budget, CALL_NANOS)
            assert await budget(gate, caller) == (130_000_000, CALL_NANOS)  # counted by the new seed already
            assert await windows(gate, caller) == (None, "975")  # 5 tokens used, 20 reserved
        finally:
            await client.aclose()
            await gate.close()

    asyncio.run(body())


@pytest.mark.parametrize("on_error", ["open", "closed"])
def test_a_seed_the_ledger_cannot_give_goes_by_the_policy_and_the_limits_still_hold(tmp_path, redis_url, on_error):
    async def body():
        gate = make_gate(tmp_path, redis_url, Seed(error=OSError("ledger down")), on_error)
        caller = Principal(key_id=new_key(), name="unseeded", budget_usd=1.0, rpm=1)
        try:
            if on_error == "closed":
                with pytest.raises(ServiceUnavailableError):
                    await gate.admit(caller, MODEL, 10, 10)
                return
            first = await admit(gate, caller)  # admitted without a budget reservation, through the limits
            assert first.budget is None and first.decision.allowed
            assert (await admit(gate, caller)).limit_kind == "requests"
        finally:
            await gate.close()

    asyncio.run(body())


def test_stores_on_different_redises_or_in_process_are_asked_in_turn(tmp_path, redis_url):
    async def body():
        limiter, other = RedisLimiter(redis_url), RedisLimiter(redis_url.rsplit("/", 1)[0] + "/1")
        budgets = RedisBudgets(redis_url, Seed())
        try:
            assert isinstance(budgets.joint_with(limiter), RedisJoint)
            assert budgets.joint_with(other) is None and budgets.joint_with(InProcessLimiter()) is None
            assert InProcessBudgets(Seed()).joint_with(limiter) is None
        finally:
            for store in (limiter, other, budgets):
                await store.close()

    asyncio.run(body())
