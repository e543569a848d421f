"""A database that is down: a store call is a 503 with Retry-After, those after it refused at
once until the retry time; a runner waits the outage out and then works, never dying of it."""

import asyncio
import time

import pytest

import tokenway.batches.database as database
from tokenway.batches import BatchStoreUnavailable, open_batch_store
from tokenway.batches.runner import BatchRunner
from tokenway.protocol.errors import openai_error_body

from .conftest import make_batch, succeeded

pytestmark = pytest.mark.anyio


async def test_a_database_down_is_a_503_with_retry_after(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "RETRY_FIRST_S", 60.0)
    store = open_batch_store(f"sqlite://{tmp_path}/missing-dir/ledger.db")
    try:
        with pytest.raises(BatchStoreUnavailable) as caught:
            await store.get_batch("batch_x", "key-a")
        assert (caught.value.status, caught.value.headers["retry-after"]) == (503, "60")
        assert openai_error_body(caught.value)["error"]["code"] == "batch_store_unavailable"
        with pytest.raises(BatchStoreUnavailable):  # at once: the database is not tried again yet
            await store.claim("w1", 1, 60, time.time())
    finally:
        await store.close()


async def test_a_runner_rides_out_an_outage(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(database, "RETRY_MAX_S", 0.05)
    directory = tmp_path / "later"
    store = open_batch_store(f"sqlite://{directory}/ledger.db")
    calls = []

    async def execute(line):
        calls.append(line.index)
        return succeeded(line.index)

    runner = BatchRunner(store, execute, "w1", lambda: 10, 30.0, poll_s=0.02, upkeep_s=0.05)
    task = runner.start()
    try:
        await asyncio.sleep(0.3)  # claims and upkeep fail all along
        assert not task.done()
        directory.mkdir()
        while True:  # the store may still be waiting out its retry time
            try:
                batch = await make_batch(store, 3, now=time.time())
                break
            except BatchStoreUnavailable as exc:
                await asyncio.sleep(exc.retry_after or 0.01)
        for _ in range(1500):
            if (await store.get_batch(batch.id, "key-a")).status == "completed":
                break
            await asyncio.sleep(0.02)
        assert sorted(calls) == [0, 1, 2]
        assert (await store.get_batch(batch.id, "key-a")).status == "completed"
    finally:
        await runner.stop(grace_s=2)
        await store.close()


def test_a_bad_url_is_refused_when_the_store_is_opened():
    for url, message in [("mysql://db", "expected sqlite"), ("sqlite://", "absolute"),
                         ("postgresql://h/db?nosuchoption=1", "nosuchoption")]:
        with pytest.raises(ValueError, match=message):
            open_batch_store(url)
