"""BatchRunner against a real store: lines run once each, within capacity; a line that raises is
a failed outcome; two runners (two gateways) on one database share a batch with no line run
twice; a runner killed mid-batch leaves its lines to their lease, and another runs each once."""

import asyncio
import collections
import json
import time

import pytest

from tokenway.batches import BatchCounts, BatchLine, LineOutcome, open_batch_store
from tokenway.batches.runner import BatchRunner

from .conftest import make_batch, succeeded

pytestmark = pytest.mark.anyio


async def eventually(predicate, what: str, bound_s: float = 30.0) -> None:
    """Wait until predicate() (awaitable) holds; the bound only keeps a broken runner from hanging the test."""
    deadline = time.monotonic() + bound_s
    while not await predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def runner(store, execute, worker_id: str, *, capacity=lambda: 100, lease_s: float = 30.0, **kwargs) -> BatchRunner:
    return BatchRunner(store, execute, worker_id, capacity, lease_s, poll_s=0.05, upkeep_s=0.2, **kwargs)


async def ended(store, batch_id: str, key_id: str = "key-a") -> bool:
    batch = await store.get_batch(batch_id, key_id)
    return batch.status in ("completed", "cancelled", "expired")


async def output_ids(store, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    return [json.loads(line)["custom_id"] for line in (await store.file_content(file_id, "key-a")).decode().split("\n")
            if line]


async def test_a_runner_works_through_a_batch_within_capacity_and_a_raising_line_fails(store):
    batch = await make_batch(store, 12, now=time.time())
    num_running, peak = 0, 0

    async def execute(line: BatchLine) -> LineOutcome:
        nonlocal num_running, peak
        num_running += 1
        peak = max(peak, num_running)
        try:
            await asyncio.sleep(0.01)
            if line.index == 5:
                raise RuntimeError("the replica went away")
            return succeeded(line.index)
        finally:
            num_running -= 1

    the_runner = runner(store, execute, "w1", capacity=lambda: 3)
    the_runner.start()
    try:
        await eventually(lambda: ended(store, batch.id), "the batch ends")
    finally:
        await the_runner.stop(grace_s=5)
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "completed" and done.counts == BatchCounts(12, succeeded=11, failed=1)
    assert 1 <= peak <= 3
    assert await output_ids(store, done.output_file_id) == [f"req-{i}" for i in range(12) if i != 5]
    [failed] = [json.loads(line) for line in (await store.file_content(done.error_file_id, "key-a")).splitlines()]
    assert failed["custom_id"] == "req-5" and failed["response"]["status_code"] == 500
    assert "RuntimeError: the replica went away" in failed["response"]["body"]["error"]["message"]


async def test_no_capacity_no_claims(store):
    batch = await make_batch(store, 2, now=time.time())
    calls = []

    async def execute(line):
        calls.append(line)
        return succeeded(line.index)

    idle = runner(store, execute, "w1", capacity=lambda: 0)
    idle.start()
    await asyncio.sleep(0.3)  # several looks for work, none taken
    await idle.stop()
    assert calls == [] and (await store.get_batch(batch.id, "key-a")).counts.pending == 2


async def test_capacity_is_a_total_so_a_measure_blind_to_new_lines_bounds_them(store):
    """An engine counts a line once it reaches it, a step or a probe later: a capacity measured
    there does not drop as the runner starts lines, and must not make it start more than it says."""
    await make_batch(store, 10, now=time.time())
    gate = asyncio.Event()

    async def execute(line: BatchLine) -> LineOutcome:
        await gate.wait()
        return succeeded(line.index)

    the_runner = runner(store, execute, "w1", capacity=lambda: 3)
    the_runner.start()
    try:
        await eventually(lambda: asyncio.sleep(0, the_runner.num_running == 3), "three lines run")
        await asyncio.sleep(0.3)  # several looks for work, with lines ending none
        assert the_runner.num_running == 3
    finally:
        gate.set()
        await the_runner.stop(grace_s=5)


async def test_two_gateways_on_one_database_share_a_batch_and_run_no_line_twice(shared_url):
    stores = [open_batch_store(shared_url), open_batch_store(shared_url)]  # a gateway each
    runs: collections.Counter[int] = collections.Counter()
    worker_to_num_lines: collections.Counter[str] = collections.Counter()
    try:
        batch = await make_batch(stores[0], 60, now=time.time())

        def executor(worker_id):
            async def execute(line: BatchLine) -> LineOutcome:
                runs[line.index] += 1
                worker_to_num_lines[worker_id] += 1
                await asyncio.sleep(0.005)
                return succeeded(line.index)
            return execute

        runners = [runner(store, executor(f"gw{i}"), f"gw{i}", max_running=4, max_claim=2)
                   for i, store in enumerate(stores)]
        for each in runners:
            each.start()
        try:
            await eventually(lambda: ended(stores[1], batch.id), "the batch ends")
        finally:
            for each in runners:
                await each.stop(grace_s=5)
        assert runs == {i: 1 for i in range(60)}
        assert set(worker_to_num_lines) == {"gw0", "gw1"}  # both took part
        done = await stores[1].get_batch(batch.id, "key-a")
        assert done.counts == BatchCounts(60, succeeded=60)
        assert await output_ids(stores[0], done.output_file_id) == [f"req-{i}" for i in range(60)]
    finally:
        for store in stores:
            await store.close()


async def test_a_runner_killed_mid_batch_leaves_its_lines_to_another_after_the_lease(shared_url):
    stores = [open_batch_store(shared_url), open_batch_store(shared_url)]
    started: set[int] = set()
    finished: collections.Counter[int] = collections.Counter()
    try:
        batch = await make_batch(stores[0], 10, now=time.time())

        async def hangs(line: BatchLine) -> LineOutcome:
            started.add(line.index)
            await asyncio.Event().wait()  # until killed
            raise AssertionError("unreachable")

        async def execute(line: BatchLine) -> LineOutcome:
            finished[line.index] += 1
            return succeeded(line.index)

        doomed = runner(stores[0], hangs, "gw-doomed", capacity=lambda: 4, lease_s=0.5)
        task = doomed.start()
        await eventually(lambda: asyncio.sleep(0, len(started) == 4), "the first runner holds four lines")
        task.cancel()  # killed: no finish, no renewal, its claims abandoned
        await asyncio.gather(task, return_exceptions=True)
        assert doomed.num_running == 0
        heir = runner(stores[1], execute, "gw-heir")
        heir.start()
        try:
            await eventually(lambda: ended(stores[1], batch.id), "the batch ends")
        finally:
            await heir.stop(grace_s=5)
        assert finished == {i: 1 for i in range(10)}
        done = await stores[1].get_batch(batch.id, "key-a")
        assert done.counts == BatchCounts(10, succeeded=10)
        assert await output_ids(stores[1], done.output_file_id) == [f"req-{i}" for i in range(10)]
    finally:
        for store in stores:
            await store.close()


async def test_stop_lets_lines_finish_within_the_grace_then_leaves_the_rest_to_their_lease(store):
    batch = await make_batch(store, 3, now=time.time())
    release = asyncio.Event()

    async def execute(line: BatchLine) -> LineOutcome:
        if line.index == 0:
            await release.wait()  # finishes during the grace
        else:
            await asyncio.Event().wait()  # never does
        return succeeded(line.index)

    stopping = runner(store, execute, "w1", lease_s=60)
    stopping.start()
    await eventually(lambda: asyncio.sleep(0, stopping.num_running == 3), "three lines run")
    stop = asyncio.create_task(stopping.stop(grace_s=0.5))
    await asyncio.sleep(0.05)
    release.set()
    await stop
    counts = (await store.get_batch(batch.id, "key-a")).counts
    assert counts == BatchCounts(3, succeeded=1, pending=2)  # the two cut off keep their claims
    assert await store.claim("w2", 10, 60, time.time()) == []
    assert len(await store.claim("w2", 10, 60, time.time() + 61)) == 2  # once their lease has lapsed


async def test_a_cancelled_batch_keeps_what_ran_and_stops_its_running_lines(store):
    batch = await make_batch(store, 6, now=time.time())
    started, stopped = [], []

    async def execute(line: BatchLine) -> LineOutcome:
        if line.index < 2:
            return succeeded(line.index)
        started.append(line.index)
        try:
            await asyncio.Event().wait()  # in the engine, running or waiting, until stopped
        except asyncio.CancelledError:
            stopped.append(line.index)
            raise
        raise AssertionError("unreachable")

    the_runner = runner(store, execute, "w1", capacity=lambda: 2)
    the_runner.start()
    try:
        # Lines 2 and 3 running (claimed), not only counted: a line's success is counted a loop
        # turn before its task leaves num_running, so "two done, two running" alone can be the
        # first two lines, and a cancel then finds nothing running.
        await eventually(lambda: asyncio.sleep(0, len(stopped) == 0 and sorted(started) == [2, 3]
                                                and (the_runner.stats.num_lines_by_outcome["succeeded"] == 2)),
                         "two lines done, two running")
        assert (await store.cancel_batch(batch.id, "key-a")).status == "cancelling"
        await eventually(lambda: ended(store, batch.id), "the batch ends")
    finally:
        await the_runner.stop(grace_s=5)
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "cancelled" and done.counts == BatchCounts(6, succeeded=2, cancelled=4)
    assert sorted(stopped) == [2, 3]  # stopped at once, not left to run on


async def test_a_batch_cancelled_through_another_gateway_stops_the_lines_running_here(shared_url):
    stores = [open_batch_store(shared_url), open_batch_store(shared_url)]
    try:
        batch = await make_batch(stores[0], 4, now=time.time())

        async def execute(line: BatchLine) -> LineOutcome:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        the_runner = runner(stores[0], execute, "w1")
        the_runner.start()
        try:
            await eventually(lambda: asyncio.sleep(0, the_runner.num_running == 4), "every line runs")
            assert (await stores[1].cancel_batch(batch.id, "key-a")).status == "cancelling"
            await eventually(lambda: ended(stores[1], batch.id), "the batch ends")  # at the runner's next upkeep
            assert the_runner.num_running == 0
        finally:
            await the_runner.stop(grace_s=5)
        done = await stores[1].get_batch(batch.id, "key-a")
        assert done.status == "cancelled" and done.counts == BatchCounts(4, cancelled=4)
    finally:
        for each in stores:
            await each.close()


async def test_a_line_refused_for_now_is_run_again_after_its_wait_not_failed(store, monkeypatch):
    """A 429 (the key's limits or budget) or a 503 (no capacity) defers the line: it runs again once
    the wait it asked for is over, its attempts not counted, and ends as its later answer."""
    import tokenway.batches.runner as runner_module

    monkeypatch.setattr(runner_module, "MIN_DEFER_S", 0.05)
    batch = await make_batch(store, 4, now=time.time())
    runs = collections.Counter()

    async def execute(line: BatchLine) -> LineOutcome:
        runs[line.index] += 1
        if line.index in (1, 2) and runs[line.index] <= 4:  # more refusals than MAX_ATTEMPTS allows crashes
            status = 429 if line.index == 1 else 503
            return LineOutcome("failed", status, {"error": {"message": "slow down"}}, None, retry_after=0.0)
        return succeeded(line.index)

    the_runner = runner(store, execute, "w1")
    the_runner.start()
    try:
        await eventually(lambda: ended(store, batch.id), "the batch ends")
    finally:
        await the_runner.stop(grace_s=5)
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "completed" and done.counts == BatchCounts(4, succeeded=4)
    assert runs == {0: 1, 1: 5, 2: 5, 3: 1}
