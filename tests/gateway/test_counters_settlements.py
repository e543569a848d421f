"""gateway/counters.py's settlements: sent without waiting for an answer, yet run by the owner
before any admission the same client asks after them, and all delivered when a client closes."""

from __future__ import annotations

import asyncio
import tempfile

from tokenway.gateway.budgets import BudgetState, InProcessBudgets
from tokenway.gateway.counters import CounterClient, CounterServer, RemoteBudgets, RemoteLimiter
from tokenway.gateway.limits import InProcessLimiter, LimitSpec


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


def test_requests_split_across_reads_and_many_in_one_read_are_each_answered_once(loop_factory):
    """The owner reads a byte stream: a request cut in two by the transport, and a burst of
    pipelined ones arriving in one read, are each answered once, in one write per read."""

    async def test(path: str, owner: InProcessLimiter, budgets: InProcessBudgets) -> None:
        import json

        reader, writer = await asyncio.open_unix_connection(path)
        spec = [None, 1000, None, None]  # LimitSpec's fields in order: tpm 1000
        burst = b"".join(json.dumps([i, "admit", ["k", spec, 100, None]]).encode() + b"\n" for i in range(5))
        half = len(burst) // 2 + 3  # mid-line
        writer.write(burst[:half])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(burst[half:] + json.dumps([None, "reconcile", [["k", "nope", 1, 0.0, False], 1]]).encode()
                     + b"\n" + json.dumps([5, "headers", ["k", spec]]).encode() + b"\n")
        await writer.drain()
        answers = [json.loads(await reader.readline()) for _ in range(6)]
        assert sorted(answer[0] for answer in answers) == list(range(6))
        assert all(status == "ok" for _, status, _ in answers)
        decisions = [result for request_id, _, result in answers if request_id < 5]
        assert [allowed for allowed, *_ in decisions] == [True] * 5
        headers = next(result for request_id, _, result in answers if request_id == 5)
        assert headers["x-ratelimit-remaining-tokens"] == "500"
        writer.close()

    run_with_owner(test, loop_factory)


def test_a_line_that_is_not_json_ends_that_connection_only(loop_factory):
    async def test(path: str, owner: InProcessLimiter, budgets: InProcessBudgets) -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"{not json\n")
        assert await reader.read() == b""  # the owner closed it
        limiter = RemoteLimiter(CounterClient(path))
        assert (await limiter.admit("k", LimitSpec(rpm=1), 0)).allowed  # others are served
        await limiter.close()

    run_with_owner(test, loop_factory)
