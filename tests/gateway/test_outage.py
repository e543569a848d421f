"""limits_on_error: what calls get while the limits store is down, the outage's log lines, the
settlements kept and replayed; and the Gatekeeper on a Redis that is not there."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid

import pytest

from tokenway.billing.ledger import Ledger, UsageRecord
from tokenway.billing.pricing import ModelPrice, PriceTable
from tokenway.gateway.auth import Principal
from tokenway.gateway.budgets_redis import RedisBudgets
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import LimitsUnavailable
from tokenway.gateway.limits_redis import RedisLimiter
from tokenway.gateway.outage import StoreGuard
from tokenway.protocol.errors import RateLimitError, ServiceUnavailableError


class FlakyStore:
    """A store that is up or down on command, counting the calls that reached it."""

    def __init__(self) -> None:
        self.down = False
        self.num_calls = 0
        self.settled: list[int] = []

    async def answer(self) -> str:
        self.num_calls += 1
        if self.down:
            raise LimitsUnavailable("redis://127.0.0.1:1/0: ConnectionError: refused")
        return "ok"

    async def settle(self, value: int) -> None:
        await self.answer()
        self.settled.append(value)


def outage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokenway.gateway.outage"]


def test_open_skips_a_down_store_between_probes_and_logs_the_outage_twice(caplog):
    async def body():
        guard, store = StoreGuard("open", probe_interval_s=0.2), FlakyStore()
        assert await guard.call("limits", store.answer) == "ok"
        store.down = True
        for _ in range(20):
            with pytest.raises(LimitsUnavailable):
                await guard.call("limits", store.answer)
            guard.by_policy()  # open: the call goes on
        assert store.num_calls == 2  # one failure; the other 19 never waited on it
        await asyncio.sleep(0.25)
        with pytest.raises(LimitsUnavailable):
            await guard.call("limits", store.answer)  # the probe, still down
        assert store.num_calls == 3
        store.down = False
        with pytest.raises(LimitsUnavailable):
            await guard.call("limits", store.answer)  # not due yet
        await asyncio.sleep(0.25)
        assert await guard.call("limits", store.answer) == "ok"
        assert await guard.call("limits", store.answer) == "ok" and not guard.is_down

    caplog.set_level(logging.INFO)
    asyncio.run(body())
    lines = outage_lines(caplog)
    assert len(lines) == 2 and not any(r.exc_info for r in caplog.records)
    assert lines[0].startswith("tokenway: limits store unavailable (redis://127.0.0.1:1/0: ConnectionError")
    assert "limits_on_error=open: admitting calls without" in lines[0]
    assert "answering again after" in lines[1] and "20 calls admitted by limits_on_error=open" in lines[1]


def test_closed_refuses_with_503_limits_unavailable_and_retry_after():
    guard = StoreGuard("closed")
    with pytest.raises(ServiceUnavailableError) as info:
        guard.by_policy()
    error = info.value
    assert error.status == 503 and error.code == "limits_unavailable"
    assert error.headers == {"retry-after": "1", "retry-after-ms": "1000"}
    with pytest.raises(ValueError, match="limits_on_error"):
        StoreGuard("ajar")


def test_settlements_a_down_store_missed_are_replayed_once_it_answers():
    async def body():
        guard, budgets, limits = StoreGuard("open", probe_interval_s=0.05), FlakyStore(), FlakyStore()
        budgets.down = limits.down = True
        for value in (1, 2, 3):
            await guard.settle("budgets", lambda value=value: budgets.settle(value))
            await guard.settle("limits", lambda value=value: limits.settle(value))
        assert budgets.settled == limits.settled == []
        budgets.down = limits.down = False
        await asyncio.sleep(0.06)
        await asyncio.gather(guard.settle("budgets", lambda: budgets.settle(4)),  # the probes that find them back
                             guard.settle("limits", lambda: limits.settle(4)))
        await guard.close()  # the replays run in the background
        assert sorted(budgets.settled) == sorted(limits.settled) == [1, 2, 3, 4]

    asyncio.run(body())


def test_an_operation_on_both_stores_goes_by_both_breakers():
    async def body():
        guard, store, both = StoreGuard("open", probe_interval_s=0.05), FlakyStore(), ("budgets", "limits")
        store.down = True
        await guard.settle(both, lambda: store.settle(7))  # fails: both stores are down, the settlement kept
        for stores in ("budgets", "limits", both):
            with pytest.raises(LimitsUnavailable):
                await guard.call(stores, store.answer)
        assert store.num_calls == 1
        store.down = False
        await asyncio.sleep(0.06)
        assert await guard.call("limits", store.answer) == "ok"  # limits' probe: budgets is still down ...
        store.down = True
        with pytest.raises(LimitsUnavailable):
            await guard.call("budgets", store.answer)  # ... and its probe fails
        store.down = False
        with pytest.raises(LimitsUnavailable, match="budgets store down"):
            await guard.call(both, store.answer)  # skipped while one of them is down
        assert store.num_calls == 3 and store.settled == []
        await asyncio.sleep(0.06)
        assert await guard.call(both, store.answer) == "ok" and not guard.is_down
        await guard.close()  # the replay runs in the background
        assert store.settled == [7]

    asyncio.run(body())


def test_a_flapping_store_logs_one_outage_a_minute(caplog):
    async def body():
        guard, store = StoreGuard("open", probe_interval_s=0.0), FlakyStore()
        for _ in range(3):
            store.down = True
            with pytest.raises(LimitsUnavailable):
                await guard.call("limits", store.answer)
            store.down = False
            await guard.call("limits", store.answer)

    caplog.set_level(logging.INFO)
    asyncio.run(body())
    assert len(outage_lines(caplog)) == 2  # the first outage's start and end; the next two within the minute


# ---- the Gatekeeper on a Redis that is not there -----------------------------------------------

MODEL = "m"


def dead_redis_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def make_gatekeeper(tmp_path, on_error: str) -> Gatekeeper:
    url = dead_redis_url()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    return Gatekeeper(KeyStore(tmp_path / "keys.db"), RedisLimiter(url), ledger,
                      PriceTable({MODEL: ModelPrice(input=1000.0, output=1000.0)}), Defaults(), host="127.0.0.1",
                      budgets=RedisBudgets(url, ledger.spend_usd), limits_on_error=on_error)


def spent_row(key_id: str, cost_usd: float) -> UsageRecord:
    now = time.time()
    return UsageRecord(f"req_{uuid.uuid4().hex}", key_id, MODEL, 10, 0, 10, cost_usd, "stop", None, 200, {}, now, now)


def test_open_admits_without_redis_but_the_ledger_still_stops_a_spent_budget(tmp_path):
    async def body():
        gate = make_gatekeeper(tmp_path, "open")
        try:
            limited = Principal(key_id="k_00000001", name="limited", rpm=1, budget_usd=1.0)
            for _ in range(3):  # rpm 1 and a budget, but nothing to check them against: admitted
                admission = await gate.admit(limited, MODEL, 10, 10)
                assert admission.decision is None and admission.budget is None and admission.rate_headers == {}
            assert await gate.rate_headers(limited) == {}
            spent = Principal(key_id="k_00000002", name="spent", budget_usd=0.5)
            await gate.ledger.record(spent_row(spent.key_id, 0.5))
            with pytest.raises(RateLimitError) as info:
                await gate.admit(spent, MODEL, 10, 10)
            assert info.value.code == "insufficient_quota"
            assert info.value.message == "This API key has used its budget: $0.50 of $0.50 spent, nothing remains."
        finally:
            await gate.close()

    asyncio.run(body())


def test_closed_refuses_every_call_it_cannot_check_with_503(tmp_path):
    async def body():
        gate = make_gatekeeper(tmp_path, "closed")
        try:
            for caller in (Principal(key_id="k_00000003", name="limited", rpm=10),
                           Principal(key_id="k_00000004", name="budgeted", budget_usd=1.0)):
                with pytest.raises(ServiceUnavailableError) as info:
                    await gate.admit(caller, MODEL, 10, 10)
                assert info.value.code == "limits_unavailable" and info.value.retry_after == 1.0
            # A key with neither limits nor a budget has nothing to check.
            unlimited = await gate.admit(Principal(key_id="k_00000005", name="unlimited"), MODEL, 10, 10)
            assert unlimited.decision is None and unlimited.budget is None
        finally:
            await gate.close()

    asyncio.run(body())


def test_a_budget_whose_spend_nobody_can_read_is_never_admitted_on_no_figure(tmp_path):
    async def body():
        gate = make_gatekeeper(tmp_path, "open")  # Redis down, and the ledger cannot say either

        async def unreadable(key_id: str) -> float:
            raise OSError("the ledger's database is unreachable")

        gate.ledger.spend_usd = unreadable
        try:
            with pytest.raises(ServiceUnavailableError) as info:
                await gate.admit(Principal(key_id="k_00000005", name="budgeted", budget_usd=1.0), MODEL, 10, 10)
            assert info.value.code == "budget_unavailable" and info.value.headers["retry-after"] == "1"
            # A key without a budget has no money at stake: open admits it.
            await gate.admit(Principal(key_id="k_00000006", name="plain", rpm=10), MODEL, 10, 10)
        finally:
            await gate.close()

    asyncio.run(body())
