"""AsyncEngine: the engine thread serves asyncio callers without blocking their loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenway.engine.client import AsyncEngine
from tokenway.protocol.sampling import SamplingParams

from .conftest import assert_sent_whole, collect, prompt_ids

PRINTING_PRESS = "The history of the printing press"
GREEDY_20 = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(llm):
    """Offline outputs, taken before the engine thread starts: once it drives llm's core, a
    second driver stepping the same core from this thread would race it."""
    prompt = llm.tokenizer.encode(PRINTING_PRESS, add_special_tokens=False)
    return {PRINTING_PRESS: llm.generate([{"prompt_token_ids": prompt}], GREEDY_20)[0].outputs[0]}


@pytest.fixture(scope="module")
def engine(llm, offline):
    engine = AsyncEngine(core=llm.engine)
    yield engine
    engine.shutdown()


def test_streams_deltas_that_add_up_to_the_offline_text(engine, offline):
    deltas, last = asyncio.run(collect(engine, prompt_ids(engine, PRINTING_PRESS), GREEDY_20))
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert "".join(deltas) == last.outputs[0].text
    assert len(deltas) > 5  # it streamed, not one lump
    reference = offline[PRINTING_PRESS]
    assert last.outputs[0].token_ids == reference.token_ids and last.outputs[0].text == reference.text


def test_final_only_sends_the_reply_whole_in_one_output(engine, offline):
    deltas, last = asyncio.run(collect(engine, prompt_ids(engine, PRINTING_PRESS), GREEDY_20, final_only=True))
    assert_sent_whole(deltas, last, offline[PRINTING_PRESS])
    assert last.outputs[0].finish_reason == "length"


def test_final_only_aborted_sends_what_it_had_whole(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        outputs = []

        async def abort_soon():
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # a few steps: tokens computed that nothing has been sent yet
            await engine.abort("to-abort-whole")

        aborter = asyncio.create_task(abort_soon())
        async for output in engine.generate(prompt_ids(engine, "Once upon a time"), params,
                                            request_id="to-abort-whole", final_only=True):
            outputs.append(output)
        await aborter
        return outputs

    outputs = asyncio.run(main())
    completion = outputs[-1].outputs[0]
    assert len(outputs) == 1 and completion.finish_reason == "abort"
    assert completion.delta_token_ids == completion.token_ids and completion.token_ids
    assert completion.delta_text == completion.text


def test_event_loop_stays_responsive_while_the_engine_works(engine):
    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = time.monotonic()
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        await asyncio.gather(*(collect(engine, prompt_ids(engine, f"Story number {i}:"), params) for i in range(4)))
        elapsed = time.monotonic() - started
        stop.set()
        await task
        return ticks, elapsed

    ticks, elapsed = asyncio.run(main())
    # A loop blocked by the model would tick a handful of times; a free one ticks all along.
    assert ticks >= max(10, elapsed / 0.005 * 0.2), (ticks, elapsed)


def test_leaving_the_stream_aborts_and_frees_blocks(engine, llm):
    kv = llm.engine.kv_manager

    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        streams = [engine.generate(prompt_ids(engine, f"Count to a thousand, take {i}:"), params) for i in range(6)]
        for stream in streams:
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 3:
                    break
            await stream.aclose()
        for _ in range(200):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_explicit_abort_ends_the_stream_with_abort(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        last = None
        async for output in engine.generate(prompt_ids(engine, "Once upon a time"), params, request_id="to-abort"):
            last = output
            if len(output.outputs[0].token_ids) == 2:
                await engine.abort("to-abort")
        return last

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"


def test_bad_prompt_raises_before_anything_runs(engine):
    async def main():
        async for _ in engine.generate([], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(main())
