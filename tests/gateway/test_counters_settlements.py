"""gateway/counters.py's settlements: sent without waiting for an answer, yet run by the owner
before any admission the same client asks after them, and all delivered when a client closes."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

from tokenway.gateway.budgets import BudgetState, InProcessBudgets
from tokenway.gateway.counters import CounterClient, CounterServer, RemoteBudgets, RemoteLimiter
from tokenway.gateway.limits import InProcessLimiter, LimitSpec


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_factory(request):
    """asyncio's loop, and uvloop's (the server's)."""
    if request.param == "uvloop":
        return pytest.importorskip("uvloop").new_event_loop
    return asyncio.new_event_loop


def run_with_owner(test, loop_factory) -> None:
    """test(path, limiter, budgets): the owner's in-process stores, served on a unix socket."""

    async def spend(key_id: str) -> float:
        return 0.0

    async def main(path: str) -> None:
        limiter, budgets = InProcessLimiter(), InProcessBudgets(spend)
        server = CounterServer(limiter, budgets)
        await server.start(path)
        try:
            await test(path, limiter, budgets)
        finally:
            await server.close()

    with tempfile.TemporaryDirectory(prefix="tw-") as folder, asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main(f"{folder}/c.sock"))


def test_a_reconcile_is_run_before_the_next_admission_it_makes_room_for(loop_factory):
    async def test(path: str, owner: InProcessLimiter, budgets: InProcessBudgets) -> None:
        limiter = RemoteLimiter(CounterClient(path))
        spec = LimitSpec(tpm=1000)
        for _ in range(50):  # each call holds 600 tokens and used 1: the next fits only once it is reconciled
            decision = await limiter.admit("k", spec, 600)
            assert decision.allowed, decision
            assert decision.reservation is not None
            await limiter.reconcile(decision.reservation, 1)
        assert (await limiter.admit("k", spec, 950)).allowed  # 50 used + 950
        refused = await limiter.admit("k", spec, 1)
        assert not refused.allowed and refused.limit_kind == "tokens"
        await limiter.close()

    run_with_owner(test, loop_factory)


def test_closing_a_client_delivers_every_settlement_it_sent(loop_factory):
    async def test(path: str, owner: InProcessLimiter, budgets: InProcessBudgets) -> None:
        client = CounterClient(path)
        remote = RemoteBudgets(client)
        reservations = []
        for _ in range(200):
            decision = await remote.reserve("k", 10**12, 1000)
            assert decision.reservation is not None
            reservations.append(decision.reservation)
        for reservation in reservations:
            await remote.settle(reservation, 7)
        await remote.close()
        for _ in range(100):  # the owner reads them as its loop gets to them
            state = await budgets.state("k")
            if state is not None and state.held_nanos == 0:
                break
            await asyncio.sleep(0.01)
        assert await budgets.state("k") == BudgetState(spent_nanos=200 * 7, held_nanos=0)

    run_with_owner(test, loop_factory)
