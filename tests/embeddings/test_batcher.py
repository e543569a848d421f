"""EmbeddingEngine: concurrent calls share forward passes on one model thread, each caller gets
exactly its own vectors in its own order, and a cancelled or failed caller leaves the others be.

The concurrency tests hold the model thread inside a forward pass (GatedModel) while they queue
calls, so which calls share a pass is fixed by the test, never by timing."""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import numpy as np
import pytest
import torch

from tokenway.embeddings import EmbeddingEngine
from tokenway.embeddings.batcher import EmbeddingJob, PendingInput, take_batch
from tokenway.protocol.errors import InternalServerError, InvalidRequestError, ServiceUnavailableError

from .conftest import TEXTS, GatedModel, cosines, wait_until


@pytest.fixture
def gated(model):
    return GatedModel(model)


@pytest.fixture
def engine(gated):
    engine = EmbeddingEngine(gated)
    yield engine
    gated.gate.set()
    engine.shutdown()


def pending_of(*lengths_per_job: list[int]) -> tuple[deque[PendingInput], list[EmbeddingJob]]:
    jobs = [EmbeddingJob([[1] * n for n in lengths], None, None, np.empty((len(lengths), 4))) for lengths in
            lengths_per_job]
    return deque(item for job in jobs for item in job.pending_inputs()), jobs


# ---- take_batch ---------------------------------------------------------------------------------------


def test_a_jobs_items_queue_shortest_first():
    pending, _ = pending_of([30, 5, 12])
    assert [(item.index, item.num_tokens) for item in pending] == [(1, 5), (2, 12), (0, 30)]


def test_take_batch_caps_inputs_and_padded_tokens_in_arrival_order():
    pending, (first, second) = pending_of([10, 10, 10], [40, 10])
    # second's items queue as 10, 40. Padded tokens: 4 rows * 10 = 40 fit 100; adding the 40-token
    # item would make 5 * 40 = 200.
    batch = take_batch(pending, max_batch_inputs=8, max_batch_tokens=100)
    assert [(item.job, item.index) for item in batch] == [(first, 0), (first, 1), (first, 2), (second, 1)]
    assert [(item.job, item.index) for item in take_batch(pending, 8, 100)] == [(second, 0)]
    assert not pending


def test_take_batch_caps_rows():
    pending, _ = pending_of([3] * 5)
    assert [len(take_batch(pending, max_batch_inputs=2, max_batch_tokens=1000)) for _ in range(3)] == [2, 2, 1]


def test_take_batch_always_takes_the_first_item_and_drops_cancelled_jobs():
    pending, (cancelled, live) = pending_of([2, 2], [50, 60])
    cancelled.cancelled = True
    assert [(item.job, item.index) for item in take_batch(pending, 8, max_batch_tokens=50)] == [(live, 0)]
    assert [item.num_tokens for item in take_batch(pending, 8, max_batch_tokens=50)] == [60]  # over the cap, alone


# ---- the engine ---------------------------------------------------------------------------------------


def test_vectors_come_back_in_input_order_equal_to_the_models(engine, model):
    result = asyncio.run(engine.embed(TEXTS))
    direct = model.embed_token_ids(model.tokenize(TEXTS))
    assert result.vectors.shape == (len(TEXTS), 384) and result.vectors.dtype == np.float32
    assert cosines(result.vectors, direct).min() >= 0.9999
    assert result.num_tokens == tuple(len(ids) for ids in model.tokenize(TEXTS))
    assert result.num_prompt_tokens == sum(result.num_tokens)


def test_concurrent_calls_share_forward_passes(engine, gated, model):
    async def main():
        gated.gate.clear()
        first = asyncio.create_task(engine.embed("the first caller"))
        await wait_until(lambda: len(gated.batches) == 1)  # the model thread is inside pass 1
        others = [asyncio.create_task(engine.embed([text])) for text in TEXTS[:7]]
        await wait_until(lambda: engine.stats().num_requests == 8)
        gated.gate.set()
        return await first, await asyncio.gather(*others)

    first, others = asyncio.run(main())
    stats = engine.stats()
    assert (stats.num_requests, stats.num_inputs, stats.num_batches) == (8, 8, 2)
    assert (stats.max_batch_size, stats.mean_batch_size) == (7, 4.0)
    assert stats.num_tokens == sum(len(ids) for batch in gated.batches for ids in batch)
    for text, result in zip(TEXTS, others):
        assert cosines(result.vectors, model.embed_token_ids(model.tokenize([text])))[0] >= 0.9999
    assert first.vectors.shape == (1, 384)


def test_a_big_call_is_cut_by_the_caps_and_reassembled_in_order(gated, model):
    engine = EmbeddingEngine(gated, max_batch_inputs=3, max_batch_tokens=256)
    try:
        result = asyncio.run(engine.embed(TEXTS))
    finally:
        engine.shutdown()
    assert all(len(batch) <= 3 and len(batch) * max(map(len, batch)) <= 256 for batch in gated.batches)
    assert engine.stats().num_batches == len(gated.batches) >= 4
    assert cosines(result.vectors, model.embed_token_ids(model.tokenize(TEXTS))).min() >= 0.9999


def test_a_cancelled_caller_is_skipped_and_the_others_are_served(engine, gated, model):
    async def main():
        gated.gate.clear()
        first = asyncio.create_task(engine.embed("holds the model thread"))
        await wait_until(lambda: len(gated.batches) == 1)
        doomed = asyncio.create_task(engine.embed(["never computed", "nor this"]))
        survivor = asyncio.create_task(engine.embed("still served"))
        await wait_until(lambda: engine.stats().num_requests == 3)
        doomed.cancel()
        await wait_until(doomed.done)  # the cancellation has reached embed(), which marks the job
        gated.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return await first, await survivor

    first, survivor = asyncio.run(main())
    assert cosines(survivor.vectors, model.embed_token_ids(model.tokenize(["still served"])))[0] >= 0.9999
    assert [len(batch) for batch in gated.batches] == [1, 1]  # the cancelled call's two items never ran
    assert engine.stats().num_batch_inputs == 2


def test_a_failed_forward_pass_fails_its_callers_only(engine, gated, model):
    async def main():
        gated.fail_next = True
        with pytest.raises(InternalServerError):
            await engine.embed("this pass fails")
        return await engine.embed("the next one works")

    result = asyncio.run(main())
    assert cosines(result.vectors, model.embed_token_ids(model.tokenize(["the next one works"])))[0] >= 0.9999


def test_bad_input_is_refused_before_it_is_queued(engine):
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(engine.embed(["fine", ""]))
    assert caught.value.param == "input[1]"
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(engine.embed("fine", dimensions=256))
    assert caught.value.param == "dimensions"
    assert engine.stats().num_requests == 0


def test_shutdown_fails_waiting_calls_and_refuses_new_ones(engine, gated):
    async def main():
        gated.gate.clear()
        running = asyncio.create_task(engine.embed("in the forward pass"))
        await wait_until(lambda: len(gated.batches) == 1)
        waiting = asyncio.create_task(engine.embed("queued behind it"))
        await wait_until(lambda: engine.stats().num_requests == 2)
        engine.shutdown(timeout=0)  # closes at once; the model thread is still held in its pass
        gated.gate.set()
        assert (await running).vectors.shape == (1, 384)  # the pass under way finished
        with pytest.raises(ServiceUnavailableError):
            await waiting
        with pytest.raises(ServiceUnavailableError):
            await engine.embed("after shutdown")

    asyncio.run(main())


def test_the_model_runs_on_its_own_thread_with_its_own_thread_count(model):
    before = torch.get_num_threads()
    gated = GatedModel(model)
    engine = EmbeddingEngine(gated, num_threads=before + 1)
    try:
        async def main():
            await engine.embed("a")
            return threading.get_ident()

        loop_thread = asyncio.run(main())
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(set(gated.thread_ids)) == 1 and gated.thread_ids[0] != loop_thread
    assert gated.num_threads_seen == [before + 1, before + 1]
    # The rest of the process keeps its setting, threads started later (a chat engine's) included.
    assert torch.get_num_threads() == before
    seen_by_new_thread = []
    thread = threading.Thread(target=lambda: seen_by_new_thread.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen_by_new_thread == [before]
