"""gateway/counters.py: one owner's limits and budgets, asked by several clients over a unix socket."""

from __future__ import annotations

import asyncio

import pytest

from tokenway.gateway.budgets import InProcessBudgets, SeedUnavailable
from tokenway.gateway.counters import CounterClient, CounterServer, RemoteBudgets, RemoteLimiter
from tokenway.gateway.limits import InProcessLimiter, LimitSpec, LimitsUnavailable


async def fail_seed(key_id: str) -> float:
    raise ConnectionError("ledger down")


def run(main, loop_factory) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main)


def run_with_owner(test, loop_factory, seed=None):
    """Runs test(path, server) against a CounterServer on a unix socket under a short path."""

    async def spend(key_id: str) -> float:
        return 0.25 if key_id == "seeded" else 0.0

    async def main(path: str) -> None:
        server = CounterServer(InProcessLimiter(), InProcessBudgets(seed or spend))
        await server.start(path)
        try:
            await test(path, server)
        finally:
            await server.close()

    import tempfile

    with tempfile.TemporaryDirectory(prefix="tw-") as folder:
        run(main(f"{folder}/c.sock"), loop_factory)


def test_rpm_is_exact_across_clients(loop_factory):
    async def test(path: str, server: CounterServer) -> None:
        limiters = [RemoteLimiter(CounterClient(path)) for _ in range(4)]
        spec = LimitSpec(rpm=25, max_concurrent=100)
        decisions = await asyncio.gather(*(limiters[i % 4].admit("k", spec, 3) for i in range(100)))
        admitted = [d for d in decisions if d.allowed]
        assert len(admitted) == 25
        refused = [d for d in decisions if not d.allowed]
        assert {d.limit_kind for d in refused} == {"requests"}
        assert all(int(d.headers["retry-after"]) >= 1 for d in refused)
        # Reconciled through another client: the owner's state is the one state.
        reservation = admitted[0].reservation
        assert reservation is not None
        await limiters[3].reconcile(reservation, 1)
        headers = await limiters[2].headers("k", LimitSpec(tpm=1000))
        assert headers["x-ratelimit-remaining-tokens"] == str(1000 - 24 * 3 - 1)
        for limiter in limiters:
            await limiter.close()

    run_with_owner(test, loop_factory)


def test_budgets_reserve_settle_and_seed(loop_factory):
    async def test(path: str, server: CounterServer) -> None:
        budgets = RemoteBudgets(CounterClient(path))
        budget = 10**9  # $1
        first = await budgets.reserve("seeded", budget, 500_000_000)
        assert first.allowed and first.spent_nanos == 250_000_000
        # The first call holds half: a second worst case of 0.3 USD does not fit beside it.
        assert not (await budgets.reserve("seeded", budget, 300_000_000)).allowed
        assert first.reservation is not None
        await budgets.settle(first.reservation, 100_000_000)
        state = await budgets.state("seeded")
        assert state is not None and (state.spent_nanos, state.held_nanos) == (350_000_000, 0)
        assert await budgets.state("never-seen") is None
        await budgets.close()

    run_with_owner(test, loop_factory)


def test_a_seed_the_ledger_cannot_give_crosses_as_itself(loop_factory):
    async def test(path: str, server: CounterServer) -> None:
        budgets = RemoteBudgets(CounterClient(path))
        with pytest.raises(SeedUnavailable, match="ledger down"):
            await budgets.reserve("k", 10**9, 1)
        await budgets.close()

    run_with_owner(test, loop_factory, seed=fail_seed)


def test_an_owner_that_is_gone_is_limits_unavailable(tmp_path, loop_factory):
    async def main() -> None:
        limiter = RemoteLimiter(CounterClient(tmp_path / "nobody.sock", timeout_s=1))
        with pytest.raises(LimitsUnavailable):
            await limiter.admit("k", LimitSpec(rpm=1), 0)

    run(main(), loop_factory)


def test_an_owner_that_stops_mid_connection_is_limits_unavailable_then_back(loop_factory):
    async def test(path: str, server: CounterServer) -> None:
        limiter = RemoteLimiter(CounterClient(path, timeout_s=1))
        assert (await limiter.admit("k", LimitSpec(rpm=5), 0)).allowed
        await server.close()
        with pytest.raises(LimitsUnavailable):
            await limiter.admit("k", LimitSpec(rpm=5), 0)
        # An owner back on the same socket is found again by the next call.
        again = CounterServer(InProcessLimiter(), InProcessBudgets(fail_seed))
        await again.start(path)
        try:
            assert (await limiter.admit("k", LimitSpec(rpm=5), 0)).allowed
        finally:
            await again.close()
            await limiter.close()

    run_with_owner(test, loop_factory)
