"""A batch handed whole to an upstream's Batch API, as the store keeps it: never claimed, leased
to one gateway at a time for its steps, its upstream id recorded once, its lines' outcomes
written once however often the upstream's results are read, and cancelled or expired by the
upstream's word, not the store's."""

import dataclasses

import pytest

from tokenway.batches import LineOutcome, new_batch, open_batch_store
from tokenway.batches.lines import CANCELLED_ERROR

from .conftest import NOW, chat_body, succeeded

pytestmark = pytest.mark.anyio
UPSTREAM = "m1/b"


async def make_forwarded(store, num_lines: int, now: float = NOW):
    batch = new_batch("openai", "key-a", "/v1/chat/completions", now=now, input_file_id="file-" + "a" * 24,
                      upstream=UPSTREAM)
    return await store.create_batch(batch, [(f"req-{i}", chat_body(i)) for i in range(num_lines)])


async def test_a_forwarded_batch_is_never_claimed_and_reads_back_with_its_upstream(store):
    batch = await make_forwarded(store, 3)
    assert await store.claim("w1", 10, 60, NOW) == []
    stored = await store.get_batch(batch.id, "key-a")
    assert (stored.upstream, stored.upstream_batch_id, stored.counts.pending) == (UPSTREAM, None, 3)
    assert [(i, custom_id) for i, custom_id, _ in await store.lines_of(batch.id)] == [(0, "req-0"), (1, "req-1"),
                                                                                     (2, "req-2")]


async def test_one_gateway_at_a_time_holds_a_forwarded_batchs_lease(shared_url):
    first, second = open_batch_store(shared_url), open_batch_store(shared_url)
    try:
        batch = await make_forwarded(first, 2)
        assert [b.id for b in await first.take_forwarded(NOW, 60, 10)] == [batch.id]
        assert await second.take_forwarded(NOW + 1, 60, 10) == []
        assert [b.id for b in await second.take_forwarded(NOW + 61, 60, 10)] == [batch.id]  # the lease lapsed
        # The id is recorded once, and the lease becomes the next poll's time.
        assert await second.set_upstream(batch.id, "batch_up1", NOW + 70)
        assert not await first.set_upstream(batch.id, "batch_up2", NOW + 70)
        assert await first.take_forwarded(NOW + 69, 60, 10) == []
        (due,) = await first.take_forwarded(NOW + 70, 60, 10)
        assert due.upstream_batch_id == "batch_up1"
    finally:
        await first.close()
        await second.close()


async def test_results_are_written_once_and_the_rest_end_as_told(store):
    batch = await make_forwarded(store, 3)
    assert await store.finish_forwarded(batch.id, [(0, succeeded(0))]) == 1
    assert await store.finish_forwarded(batch.id, [(0, succeeded(9)), (1, succeeded(1))]) == 1  # 0 is done
    cancelled = LineOutcome("cancelled", None, None, CANCELLED_ERROR)
    await store.finish_forwarded(batch.id, [], cancelled)
    results = {line.index: outcome async for line, outcome in await store.results(batch.id, "key-a")}
    assert results[0].response["id"] == "chatcmpl-0" and results[1].outcome == "succeeded"
    assert results[2].outcome == "cancelled"
    assert await store.finalize_ready(NOW) == (batch.id,)
    assert (await store.get_batch(batch.id, "key-a")).status == "completed"


async def test_cancel_leaves_a_forwarded_batchs_lines_to_the_upstream(store):
    batch = await make_forwarded(store, 2)
    assert await store.set_upstream(batch.id, "batch_up", NOW)
    cancelling = await store.cancel_batch(batch.id, "key-a")
    assert cancelling.status == "cancelling" and cancelling.counts.pending == 2
    (due,) = await store.take_forwarded(NOW + 1, 60, 10)
    assert due.status == "cancelling"  # due: the cancel is forwarded at its next step
    # A batch cancelled before its submission was recorded keeps no id from it.
    other = await make_forwarded(store, 1)
    await store.cancel_batch(other.id, "key-a")
    assert not await store.set_upstream(other.id, "batch_late", NOW)


async def test_a_submitted_forwarded_batch_is_not_expired_by_the_store(store):
    batch = await make_forwarded(store, 1)
    assert await store.set_upstream(batch.id, "batch_up", NOW)
    late = NOW + 25 * 3600
    assert await store.expire(late) == ()
    assert (await store.get_batch(batch.id, "key-a")).status == "in_progress"
    unsent = await make_forwarded(store, 1)  # never reached its upstream: it expires as any batch
    assert await store.expire(late) == (unsent.id,)


async def test_a_batch_made_failed_forwards_nothing(store):
    batch = dataclasses.replace(new_batch("openai", "key-a", "/v1/chat/completions", now=NOW,
                                          errors=[{"code": "x", "message": "bad", "line": 1}], upstream=UPSTREAM))
    assert batch.upstream is None
