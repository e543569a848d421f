"""ProcessEngine (engine/process.py): the engine in a child process answers as the in-process
engine does, streams, stops, aborts and refuses as it does, and outlives its process being
killed: requests in flight fail, new ones are refused while it restarts, then it serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenway.config import EngineConfig
from tokenway.engine.client import EngineDeadError
from tokenway.engine.process import ProcessEngine
from tokenway.engine.stats import ClassStats
from tokenway.protocol.sampling import SamplingParams

from .conftest import assert_sent_whole, collect, prompt_ids

TEXTS = ("The history of the printing press", "def fibonacci(n):")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(llm):
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)} for text in TEXTS]
    return [output.outputs[0] for output in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    # The `llm` fixture's engine: float32 on float weights, so greedy text is comparable exactly.
    engine = ProcessEngine(EngineConfig(model=str(default_model_dir), dtype="float32", quantization="none",
                                        kv_cache_memory="256MiB", max_model_len=2048, max_num_batched_tokens=256,
                                        show_progress=False))
    yield engine
    engine.shutdown()


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_streams_what_the_in_process_engine_answers(engine, offline):
    async def main():
        return await asyncio.gather(*(collect(engine, prompt_ids(engine, text), GREEDY) for text in TEXTS))

    assert engine.is_alive and engine.pid not in (None, os.getpid())
    for (deltas, last), reference in zip(asyncio.run(main()), offline):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.outputs[0].token_ids == reference.token_ids and last.outputs[0].text == reference.text
        assert "".join(deltas) == reference.text and len(deltas) > 5
        assert last.metrics.first_scheduled_time <= last.metrics.first_token_time <= last.metrics.last_token_time


def test_a_stop_string_ends_the_request_in_the_engine_too(engine, offline):
    stop = offline[0].text.split()[3]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=[stop])
    deltas, last = asyncio.run(collect(engine, prompt_ids(engine, TEXTS[0]), params))
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert last.outputs[0].text == offline[0].text[: offline[0].text.index(stop)]
    assert wait_until(lambda: engine.stats().num_running == 0)  # told to finish, not left decoding to 64


def test_final_only_crosses_the_pipe_once_with_the_whole_reply(engine, offline):
    async def main():
        return await asyncio.gather(*(collect(engine, prompt_ids(engine, text), GREEDY, final_only=True)
                                      for text in TEXTS))

    for (deltas, last), reference in zip(asyncio.run(main()), offline):
        assert_sent_whole(deltas, last, reference)
        assert last.metrics.first_scheduled_time <= last.metrics.first_token_time <= last.metrics.last_token_time
    stop = offline[0].text.split()[3]  # a stop string still ends it in the engine, at the same text
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=[stop], logprobs=2)
    deltas, last = asyncio.run(collect(engine, prompt_ids(engine, TEXTS[0]), params, final_only=True))
    completion = last.outputs[0]
    assert deltas == [offline[0].text[: offline[0].text.index(stop)]] and completion.stop_reason == stop
    assert len(completion.logprobs) == len(completion.token_ids) == len(completion.delta_token_ids)


def test_logprobs_and_cached_tokens_cross_as_the_in_process_engine_gives_them(engine, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ids = llm.tokenizer.encode(TEXTS[1] * 3, add_special_tokens=False)
    reference = llm.generate([{"prompt_token_ids": ids}], params)[0]
    first = asyncio.run(collect(engine, list(ids), params))[1]
    again = asyncio.run(collect(engine, list(ids), params))[1]  # the prompt's full blocks are cached now
    completion = again.outputs[0]
    assert completion.token_ids == reference.outputs[0].token_ids and len(completion.logprobs) == 12
    for got, want in zip(completion.logprobs, reference.outputs[0].logprobs):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == len(ids) // 16 * 16


def test_leaving_early_aborts_in_the_engine(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async for output in engine.generate(prompt_ids(engine, TEXTS[1]), params):
            if len(output.outputs[0].token_ids) >= 3:
                break

    asyncio.run(main())
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_leaving_a_batch_request_mid_step_leaves_the_counts_at_once(engine):
    # The abort arrives while a batch step runs, so it waits for the step's end; the engine is
    # then empty and waits for a command, and must have sent its counts before it does.
    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async for output in engine.generate(prompt_ids(engine, TEXTS[1]), params, service_class="batch"):
            if len(output.outputs[0].token_ids) >= 3:
                break

    asyncio.run(main())
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)


def test_bad_prompts_are_refused_on_the_callers_side(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.validate_prompt([engine.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="context window"):
        engine.validate_prompt([1] * engine.max_model_len, GREEDY)


def test_a_killed_engine_fails_what_was_in_flight_and_comes_back(engine):
    dead_pid = engine.pid

    async def in_flight():
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        async for output in engine.generate(prompt_ids(engine, TEXTS[0]), params):
            if len(output.outputs[0].token_ids) == 2:
                os.kill(dead_pid, signal.SIGKILL)

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(in_flight(), 30))
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):  # refused at once while it restarts, before anything queues
        engine.validate_prompt(prompt_ids(engine, TEXTS[1]), GREEDY)
    assert wait_until(lambda: engine.is_alive, timeout=120)
    assert engine.pid != dead_pid and engine.stats().engine_restarts == 1
    _, last = asyncio.run(collect(engine, prompt_ids(engine, TEXTS[1]), GREEDY))
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 16


def test_the_service_class_crosses_the_pipe_to_the_engines_counts(engine):
    def flex() -> ClassStats:
        counts = engine.stats().of_class("flex")
        assert counts is not None
        return counts

    prompt = prompt_ids(engine, TEXTS[0])
    before = flex()

    async def main():
        async for output in engine.generate(prompt, GREEDY, service_class="flex"):
            if output.finished:
                return output

    final = asyncio.run(main())
    assert final is not None and final.finished
    # The counts come with the engine's next step message: the last one may still be on its way.
    assert wait_until(lambda: flex().num_generated_tokens == before.num_generated_tokens + 16)
    assert flex().num_prompt_tokens == before.num_prompt_tokens + len(prompt)


def test_interactive_requests_start_between_the_layers_of_a_batch_step_and_answer_the_same(engine, offline):
    """Requests of a better class sent while batch requests keep the engine busy: some of them
    (whichever arrive mid-step rather than between two steps) run in a step of their own
    interjected in a batch step; each answers as it does alone, and so do the batch requests."""
    batch_params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    batch_prompts = [prompt_ids(engine, f"{TEXTS[0]}, part {i}") for i in range(8)]
    interactive = prompt_ids(engine, TEXTS[1])
    before = engine.stats().num_interjected_steps

    async def main():
        async def one(prompt, params, service_class):
            final = None
            async for output in engine.generate(prompt, params, service_class=service_class):
                final = output
            return final

        batch = [asyncio.create_task(one(prompt, batch_params, "batch")) for prompt in batch_prompts]
        answers = []
        while not answers or (engine.stats().num_interjected_steps == before and len(answers) < 12):
            await asyncio.sleep(0.05)  # the batch steps go on meanwhile
            answers.append(await one(interactive, GREEDY, "default"))
        return answers, await asyncio.gather(*batch)

    answers, batch = asyncio.run(main())
    assert engine.stats().num_interjected_steps > before
    assert all(answer.outputs[0].token_ids == offline[1].token_ids for answer in answers)
    solo = asyncio.run(collect(engine, batch_prompts[0], batch_params))[1]
    assert batch[0].outputs[0].token_ids == solo.outputs[0].token_ids
    assert all(len(output.outputs[0].token_ids) == 96 for output in batch)
