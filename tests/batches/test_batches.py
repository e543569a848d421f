"""Batches on every backend: made in one transaction, read back for their owner only, listed
newest first; claims under a lease, each line's outcome written once; finalization writes the
files once; cancel and expiry end the lines no runner holds and keep those running."""

import json
import time

import pytest

from tokenway.batches import MAX_ATTEMPTS, BatchCounts, LineOutcome, new_batch, open_batch_store
from tokenway.protocol.errors import FieldError

from .conftest import NOW, chat_body, make_batch, succeeded

pytestmark = pytest.mark.anyio


async def jsonl(store, file_id, key_id="key-a") -> list[dict]:
    return [json.loads(line) for line in (await store.file_content(file_id, key_id)).decode().splitlines()]


async def test_a_batch_reads_back_as_created_for_its_owner_only(store):
    created = await make_batch(store, 3)
    assert created.status == "in_progress" and created.model == "m1"
    assert created.counts == BatchCounts(3, pending=3)
    assert await store.get_batch(created.id, "key-a") == created
    assert await store.get_batch(created.id, "key-b") is None
    assert await store.cancel_batch(created.id, "key-b") is None
    assert await store.results(created.id, "key-b") is None
    assert created.completion_window_s == 24 * 3600 and created.status_times == {"in_progress_at": NOW}


async def test_a_refused_input_makes_a_failed_batch_with_its_errors_and_no_lines(store):
    errors = [{"code": "invalid_request", "line": 2, "message": "custom_id is missing", "param": None}]
    batch = new_batch("openai", "key-a", "/v1/embeddings", now=NOW, input_file_id="file-" + "b" * 24, errors=errors)
    created = await store.create_batch(batch, [])
    stored = await store.get_batch(created.id, "key-a")
    assert (stored.status, stored.errors, stored.status_times) == ("failed", tuple(errors), {"failed_at": NOW})
    assert stored.processing_status == "ended" and stored.ended_at == NOW
    assert await store.claim("w1", 10, 60, NOW) == []
    with pytest.raises(ValueError, match="unique"):
        await store.create_batch(new_batch("openai", "key-a", "/v1/embeddings", now=NOW),
                                 [("same", chat_body(0)), ("same", chat_body(1))])


async def test_batches_list_newest_first_per_api_and_key(store):
    batches = [await make_batch(store, 1, now=NOW + i) for i in range(3)]
    await make_batch(store, 1, api="anthropic")
    await make_batch(store, 1, key_id="key-b")
    first = await store.list_batches("key-a", api="openai", limit=2)
    assert [b.id for b in first.data] == [batches[2].id, batches[1].id] and first.has_more
    rest = await store.list_batches("key-a", api="openai", after=first.last_id)
    assert [b.id for b in rest.data] == [batches[0].id] and not rest.has_more
    assert rest.data[0].counts == BatchCounts(1, pending=1)
    assert len((await store.list_batches("key-a", api="anthropic")).data) == 1
    with pytest.raises(FieldError):
        await store.list_batches("key-a", api="anthropic", after=batches[0].id)


async def test_claims_take_the_oldest_batch_first_in_line_order_and_never_a_held_line(store):
    older = await make_batch(store, 3, now=NOW)
    newer = await make_batch(store, 2, now=NOW + 1)
    first = await store.claim("w1", 4, 60, NOW + 10)
    assert [(line.batch_id, line.index) for line in first] == [(older.id, 0), (older.id, 1), (older.id, 2),
                                                                (newer.id, 0)]
    line = first[0]
    assert (line.custom_id, line.body, line.endpoint, line.key_id, line.api) == (
        "req-0", chat_body(0), "/v1/chat/completions", "key-a", "openai")
    assert line.line_id == older.id.removeprefix("batch_") + "l0" and line.line_id.isalnum()
    assert line.request_id == "batch_req_" + line.line_id
    second = await store.claim("w2", 10, 60, NOW + 10)
    assert [(line.batch_id, line.index) for line in second] == [(newer.id, 1)]
    assert await store.claim("w3", 10, 60, NOW + 69) == []  # every claim still held
    assert (await store.get_batch(older.id, "key-a")).counts == BatchCounts(3, pending=3)


async def test_a_lapsed_claim_is_taken_again_and_its_first_holder_can_no_longer_finish_it(store):
    batch = await make_batch(store, 2)
    [line, other] = await store.claim("w1", 2, 60, NOW)
    assert await store.renew("w1", [other], NOW + 200) == 1  # w1 is alive for `other` only
    assert await store.renew("w2", [line], NOW + 200) == 0  # not w2's to renew
    retaken = await store.claim("w2", 10, 60, NOW + 61)
    assert retaken == [line]  # the same line, the same line_id: its ledger row is written once
    assert not await store.finish("w1", line, succeeded(0))
    assert await store.finish("w2", line, succeeded(0))
    assert not await store.finish("w2", line, succeeded(0))  # once
    assert await store.finish("w1", other, succeeded(1))
    assert (await store.get_batch(batch.id, "key-a")).counts == BatchCounts(2, succeeded=2)
    assert await store.renew("w1", [other], NOW + 300) == 0  # done: nothing to renew


async def test_a_line_whose_runners_keep_dying_fails_after_max_attempts(store):
    batch = await make_batch(store, 1)
    now = NOW
    for attempt in range(MAX_ATTEMPTS):
        assert len(await store.claim(f"w{attempt}", 1, 60, now)) == 1
        now += 61
    assert await store.claim("w-last", 1, 60, now) == []
    assert await store.finalize_ready(now) == (batch.id,)
    [error_line] = await jsonl(store, (await store.get_batch(batch.id, "key-a")).error_file_id)
    assert error_line["response"] is None and error_line["error"]["code"] == "batch_line_abandoned"


async def test_finalize_writes_openai_output_and_error_files_once(store, store_url):
    batch = await make_batch(store, 4)
    lines = await store.claim("w1", 4, 60, NOW)
    assert await store.finalize_ready(NOW) == ()  # lines still running
    await store.finish("w1", lines[0], succeeded(0))
    await store.finish("w1", lines[1], LineOutcome("failed", 400, {"error": {
        "message": "max_tokens is too large", "type": "invalid_request_error", "param": "max_tokens",
        "code": None}}, None, "req_1"))
    await store.finish("w1", lines[3], succeeded(3))
    await store.finish("w1", lines[2], LineOutcome("failed", 500, None, {"code": "internal_error",
                                                                         "message": "it broke"}))
    if store_url != "memory":  # two gateways finalizing together: one writes the files
        other = open_batch_store(store_url)
        try:
            assert await other.finalize_ready(NOW + 1) + await store.finalize_ready(NOW + 1) == (batch.id,)
        finally:
            await other.close()
    else:
        assert await store.finalize_ready(NOW + 1) == (batch.id,)
    assert await store.finalize_ready(NOW + 2) == ()
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "completed" and done.counts == BatchCounts(4, succeeded=2, failed=2)
    assert done.status_times == {"in_progress_at": NOW, "finalizing_at": NOW + 1, "completed_at": NOW + 1}
    output = await jsonl(store, done.output_file_id)
    assert [(line["custom_id"], line["response"]["status_code"]) for line in output] == [("req-0", 200), ("req-3", 200)]
    assert output[0] == {"id": lines[0].request_id, "custom_id": "req-0", "error": None,
                         "response": {"status_code": 200, "request_id": "req_0", "body": succeeded(0).response}}
    errors = await jsonl(store, done.error_file_id)
    assert [line["custom_id"] for line in errors] == ["req-1", "req-2"]
    assert errors[0]["response"]["status_code"] == 400 and errors[0]["error"] is None
    assert errors[1]["response"] is None and errors[1]["error"] == {"code": "internal_error", "message": "it broke"}
    output_file = await store.get_file(done.output_file_id, "key-a")
    assert (output_file.purpose, output_file.filename) == ("batch_output", f"{batch.id}_output.jsonl")
    assert len((await store.list_files("key-a", purpose="batch_output")).data) == 2


async def test_every_line_failing_makes_no_output_file(store):
    batch = await make_batch(store, 1)
    [line] = await store.claim("w1", 1, 60, NOW)
    await store.finish("w1", line, LineOutcome("failed", 404, {"error": {"message": "no such model"}}, None))
    await store.finalize_ready(NOW)
    done = await store.get_batch(batch.id, "key-a")
    assert done.output_file_id is None and done.error_file_id is not None


async def test_cancel_ends_the_lines_not_started_and_keeps_those_running(store):
    now = time.time()  # cancel_batch's clock: the claims' leases run on it
    batch = await make_batch(store, 4, now=now)
    running = await store.claim("w1", 2, 60, now)
    cancelling = await store.cancel_batch(batch.id, "key-a")
    assert cancelling.status == "cancelling" and cancelling.processing_status == "canceling"
    assert cancelling.counts == BatchCounts(4, cancelled=2, pending=2)
    assert await store.claim("w2", 10, 60, now + 1) == []
    assert await store.finish("w1", running[0], succeeded(0))
    assert await store.finalize_ready(now + 2) == ()  # running[1] runs on
    # running[1]'s runner dies: once its claim lapses, it is cancelled (no runner takes it).
    assert await store.finalize_ready(now + 61) == (batch.id,)
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "cancelled" and done.counts == BatchCounts(4, succeeded=1, cancelled=3)
    assert set(done.status_times) == {"in_progress_at", "cancelling_at", "finalizing_at", "cancelled_at"}
    assert [line["custom_id"] for line in await jsonl(store, done.output_file_id)] == ["req-0"]
    errors = await jsonl(store, done.error_file_id)
    assert [(line["custom_id"], line["error"]["code"]) for line in errors] == [
        ("req-1", "batch_cancelled"), ("req-2", "batch_cancelled"), ("req-3", "batch_cancelled")]
    assert (await store.cancel_batch(batch.id, "key-a")).status == "cancelled"  # final: left as it is


async def test_cancel_with_nothing_running_ends_the_batch_at_once(store):
    batch = await make_batch(store, 2)
    cancelled = await store.cancel_batch(batch.id, "key-a")
    assert cancelled.status == "cancelled" and cancelled.counts == BatchCounts(2, cancelled=2)


async def test_expiry_ends_the_lines_not_running_and_awaits_those_that_are(store):
    batch = await make_batch(store, 3, completion_window_s=100)
    [running] = await store.claim("w1", 1, 60, NOW + 90)
    assert await store.expire(NOW + 99) == ()  # not yet
    assert await store.claim("w2", 10, 60, NOW + 100) == []  # past its window: nothing more starts
    assert await store.expire(NOW + 100) == ()  # the line running is awaited...
    assert (await store.get_batch(batch.id, "key-a")).counts == BatchCounts(3, expired=2, pending=1)
    assert await store.finish("w1", running, succeeded(0))  # ...and its result kept
    assert await store.expire(NOW + 101) == (batch.id,)
    done = await store.get_batch(batch.id, "key-a")
    assert done.status == "expired" and done.counts == BatchCounts(3, succeeded=1, expired=2)
    assert done.status_times["expired_at"] == NOW + 100 and done.ended_at == NOW + 100
    assert [line["custom_id"] for line in await jsonl(store, done.output_file_id)] == ["req-0"]
    assert [line["error"]["code"] for line in await jsonl(store, done.error_file_id)] == ["batch_expired"] * 2
    assert await store.expire(NOW + 200) == ()


async def test_an_expired_batchs_line_whose_runner_died_expires_after_its_lease(store):
    batch = await make_batch(store, 1, completion_window_s=100)
    await store.claim("w1", 1, 60, NOW + 90)
    assert await store.expire(NOW + 120) == ()
    assert await store.expire(NOW + 151) == (batch.id,)


async def test_results_come_in_line_order_a_page_at_a_time(store, monkeypatch):
    import tokenway.batches.database as database

    monkeypatch.setattr(database, "RESULTS_PAGE", 3)
    batch = await make_batch(store, 8, api="anthropic")
    lines = await store.claim("w1", 8, 60, NOW)
    for line in reversed(lines):
        await store.finish("w1", line, succeeded(line.index, "anthropic"))
    results = await store.results(batch.id, "key-a")
    got = [(line.custom_id, outcome) async for line, outcome in results]
    assert got == [(f"req-{i}", succeeded(i, "anthropic")) for i in range(8)]


async def test_an_ended_batch_is_deleted_with_its_lines_and_files_and_a_running_one_is_not(store):
    from tokenway.batches import BatchNotEndedError

    batch = await make_batch(store, 2, api="anthropic")
    with pytest.raises(BatchNotEndedError, match="cancel it"):
        await store.delete_batch(batch.id, "key-a")
    assert not await store.delete_batch(batch.id, "key-b")
    ended = await store.cancel_batch(batch.id, "key-a")
    assert ended.status == "cancelled" and ended.output_file_id is not None
    assert await store.delete_batch(batch.id, "key-a")
    assert await store.get_batch(batch.id, "key-a") is None
    assert await store.get_file(ended.output_file_id, "key-a") is None
    assert not await store.delete_batch(batch.id, "key-a")


async def test_files_past_their_expiry_are_purged(store):
    from .test_files import make_file

    short, long = make_file(b"a", created_at=NOW), make_file(b"b", created_at=NOW + 7200)
    for file in (short, long):
        await store.create_file(file, b"a")
    assert await store.purge_files(NOW + 3600) == 1
    assert await store.get_file(short.id, "key-a") is None and await store.get_file(long.id, "key-a") == long
