"""What /metrics and the dashboard see of the batch queue: the store's overview (every key's
batches by status, the lines waiting and held, the oldest running batches with their counts),
and a runner's own tallies (lines by outcome, deferrals) with the overview its upkeep read."""

import time

import pytest

from tokenway.batches import BatchCounts, BatchLine, LineOutcome
from tokenway.batches.runner import BatchRunner, RunnerStats

from .conftest import make_batch, succeeded
from .test_runner import ended, eventually

pytestmark = pytest.mark.anyio


async def test_the_overview_counts_every_key_and_shows_the_oldest_running_batches(store):
    now = time.time()
    first = await make_batch(store, 5, key_id="key-a", now=now - 20)
    second = await make_batch(store, 3, key_id="key-b", now=now - 10)
    third = await make_batch(store, 2, key_id="key-a", now=now)
    claimed = await store.claim("w1", 2, 60.0, now)  # the oldest batch's first two lines
    assert await store.finish("w1", claimed[0], succeeded(0))
    await store.cancel_batch(second.id, "key-b")  # its lines never started: cancelled, and it ends

    overview = await store.overview(2)
    assert dict(overview.num_batches_by_status) == {"in_progress": 2, "cancelled": 1}
    assert (overview.num_lines_pending, overview.num_lines_claimed) == (3 + 2, 1)
    assert [batch.id for batch in overview.running] == [first.id, third.id]
    assert overview.running[0].counts == BatchCounts(5, succeeded=1, pending=4)
    assert overview.running[0].key_id == "key-a" and overview.running[1].counts == BatchCounts(2, pending=2)
    assert [batch.id for batch in (await store.overview(1)).running] == [first.id]
    assert (await store.overview(0)).running == ()


async def test_an_empty_store_has_an_empty_overview(store):
    overview = await store.overview(5)
    assert (dict(overview.num_batches_by_status), overview.num_lines_pending, overview.num_lines_claimed,
            overview.running) == ({}, 0, 0, ())


async def test_a_runner_counts_its_lines_and_deferrals_and_reads_the_queue(store):
    batch = await make_batch(store, 6, now=time.time())
    refused_once: set[int] = set()

    async def execute(line: BatchLine) -> LineOutcome:
        if line.index == 4 and line.index not in refused_once:  # limits say "later": deferred, then run
            refused_once.add(line.index)
            return LineOutcome("failed", 429, {"error": {"message": "slow down"}}, None, retry_after=0.0)
        if line.index == 5:
            return LineOutcome("failed", 400, {"error": {"message": "bad"}}, None)
        return succeeded(line.index)

    stats = RunnerStats()

    async def upkeep_saw_it_end() -> bool:
        return stats.overview is not None and stats.overview.num_batches_by_status.get("completed") == 1

    runner = BatchRunner(store, execute, "w1", lambda: 10, 30.0, poll_s=0.05, upkeep_s=0.1, stats=stats)
    assert runner.stats is stats
    runner.start()
    try:
        await eventually(lambda: ended(store, batch.id), "the batch ended")
        # Deferred lines wait MIN_DEFER_S at least: the one refused ran again after it.
        await eventually(upkeep_saw_it_end, "an upkeep read the ended batch")
    finally:
        await runner.stop(5)
    assert stats.num_lines_by_outcome == {"succeeded": 5, "failed": 1}
    assert stats.num_deferred == 1 and stats.num_running == 0
    assert stats.overview is not None and stats.overview.running == () and stats.overview_at is not None
    shown = stats.to_dict()
    assert shown["num_lines_by_outcome"] == {"succeeded": 5, "failed": 1}
    assert shown["queue"]["num_batches_by_status"] == {"completed": 1}
    assert shown["queue"]["running"] == [] and shown["queue"]["num_lines_pending"] == 0
