"""The ledger through a database outage: a real PostgreSQL stopped and started again
(scripts/postgres.sh) while rows are recorded; the same Ledger commits them, each exactly once,
without a restart, and a key's spend counts them all along."""

import asyncio
import logging
import time

import psycopg
import pytest

import tokenway.billing.writer as writer_module
from tokenway.billing.ledger import Ledger, LedgerUnavailable

from .conftest import make_record

pytestmark = pytest.mark.anyio


def committed_rows(url: str) -> list[tuple[str, float]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT request_id, cost_usd FROM usage_ledger ORDER BY request_id").fetchall()


async def wait_for(condition, timeout: float = 10.0) -> bool:
    """Poll `condition` until it holds or `timeout` passes (a deadline, not a speed claim: the
    ledger's retries are at most 5 s apart)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


class Recorder:
    """Records a row every few ms (key-a), as a gateway under load would, until stopped."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.request_id_to_cost: dict[str, float] = {}
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        for i in range(10**9):
            rec = make_record(f"r{i:06d}", cost_usd=0.001 * (i % 7 + 1))
            await self.ledger.record(rec)
            self.request_id_to_cost[rec.request_id] = rec.cost_usd
            await asyncio.sleep(0.003)

    @property
    def spend_usd(self) -> float:
        return sum(self.request_id_to_cost.values())

    async def stop(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


async def test_an_outage_is_ridden_out_by_the_running_ledger_each_row_once(own_postgres, tmp_path, caplog,
                                                                           monkeypatch):
    caplog.set_level(logging.INFO, logger=writer_module.__name__)
    url = own_postgres.new_database()
    num_connects = 0
    real_open_store = writer_module.open_store

    def counting_open_store(store_url):
        nonlocal num_connects
        num_connects += 1
        return real_open_store(store_url)

    monkeypatch.setattr(writer_module, "open_store", counting_open_store)
    async with Ledger(url, journal_dir=tmp_path, journal_name="8000") as ledger:
        assert await ledger.spend_usd("key-a") == 0.0  # seeded while the database is up
        recorder = Recorder(ledger)
        assert await wait_for(lambda: len(recorder.request_id_to_cost) >= 50)
        await asyncio.to_thread(own_postgres.stop)
        assert await wait_for(lambda: ledger.health().degraded)
        health = ledger.health()
        assert health.since is not None and health.last_error and health.num_pending_rows > 0
        assert ledger.stats()["degraded"]
        num_connects_down = num_connects
        await asyncio.sleep(1.5)  # ~500 rows: one connection per batch would be hundreds
        # A key's spend counts what waits in the journal; a key never read has no floor to give.
        assert await ledger.spend_usd("key-a") == pytest.approx(recorder.spend_usd)
        with pytest.raises(LedgerUnavailable) as unavailable:
            await ledger.spend_usd("key-unseen")
        assert unavailable.value.retry_after_s > 0
        with pytest.raises(LedgerUnavailable):
            await ledger.usage("key-a")
        assert ledger.health().num_pending_rows > health.num_pending_rows
        assert num_connects - num_connects_down < 15  # backoff, not a spin

        await asyncio.to_thread(own_postgres.start)
        assert await wait_for(lambda: not ledger.health().degraded)
        await recorder.stop()
        assert await wait_for(lambda: ledger.health().num_pending_rows == 0)
        rows = committed_rows(url)
        assert [request_id for request_id, _ in rows] == sorted(recorder.request_id_to_cost)
        # Counted once into the committed total: the replay's rows and the queue's agree.
        assert await ledger.spend_usd("key-a") == pytest.approx(recorder.spend_usd)
        assert await ledger.spend_usd("key-unseen") == 0.0
        [usage] = await ledger.usage("key-a")  # the reading connection came back too
        assert usage["requests"] == len(recorder.request_id_to_cost)
        assert len(ledger.journal_path.read_bytes().splitlines()) == 1  # back to its header
        assert ledger.health().last_error is None and ledger.dead_letters.num_rows == 0
    messages = [r.getMessage() for r in caplog.records if r.name == writer_module.__name__]
    assert len([m for m in messages if "cannot commit" in m]) == 1, messages
    [back] = [m for m in messages if "is back" in m]
    assert "rows replayed" in back and len(messages) == 2, messages


async def test_without_a_journal_rows_wait_in_memory_up_to_the_bound(own_postgres):
    url = own_postgres.new_database()
    async with Ledger(url, max_pending_rows=3) as ledger:
        await ledger.record(make_record("before", cost_usd=1.0))
        assert await ledger.spend_usd("key-a") == 1.0
        await asyncio.to_thread(own_postgres.stop)
        waiting = asyncio.create_task(ledger.record(make_record("waits-1", cost_usd=2.0)))
        assert await wait_for(lambda: ledger.health().degraded)
        for name in ("waits-2", "waits-3", "lost-1", "lost-2"):
            ledger.record_nowait(make_record(name, cost_usd=4.0))
        with pytest.raises(LedgerUnavailable):  # past the bound: its caller hears so
            await ledger.record(make_record("lost-3", cost_usd=8.0))
        assert await wait_for(lambda: ledger.health().num_rows_dropped == 3)
        assert not waiting.done()  # record() returns once its row is committed
        assert ledger.health().num_pending_rows == 3
        assert await ledger.spend_usd("key-a") == 1.0 + 2.0 + 4.0 + 4.0
        assert ledger.stats()["num_rows_dropped"] == 3

        await asyncio.to_thread(own_postgres.start)
        await asyncio.wait_for(waiting, timeout=10)
        assert [request_id for request_id, _ in committed_rows(url)] == ["before", "waits-1", "waits-2", "waits-3"]
        assert not ledger.health().degraded and ledger.health().num_pending_rows == 0
        assert await ledger.spend_usd("key-a") == 11.0


async def test_closing_during_an_outage_leaves_the_rows_in_the_journal_for_the_next_start(own_postgres, tmp_path):
    url = own_postgres.new_database()
    ledger = Ledger(url, journal_dir=tmp_path, journal_name="8000")
    await ledger.record(make_record("committed"))
    assert await wait_for(lambda: ledger.health().num_pending_rows == 0)
    await asyncio.to_thread(own_postgres.stop)
    try:
        for i in range(5):
            await ledger.record(make_record(f"journaled-{i}"))
        await ledger.close()
    finally:
        await asyncio.to_thread(own_postgres.start)
    async with Ledger(url, journal_dir=tmp_path, journal_name="8000") as restarted:
        assert restarted.health().num_pending_rows == 0  # committed before the start returned
        assert len(restarted.journal_path.read_bytes().splitlines()) == 1
    assert [request_id for request_id, _ in committed_rows(url)] == ["committed"] + [f"journaled-{i}" for i in range(5)]


async def test_a_spend_read_is_what_finds_the_outage_and_the_ledger_recovers_with_no_row_to_commit(own_postgres):
    url = own_postgres.new_database()
    async with Ledger(url) as ledger:
        await asyncio.to_thread(own_postgres.stop)
        try:
            with pytest.raises(LedgerUnavailable):
                await ledger.spend_usd("key-a")
            assert ledger.health().degraded and ledger.health().num_pending_rows == 0
        finally:
            await asyncio.to_thread(own_postgres.start)
        assert await wait_for(lambda: not ledger.health().degraded)
        assert await ledger.spend_usd("key-a") == 0.0
