"""LocalReplica (routing/replicas.py): the engine as a replica answers a job with its choices'
deltas (text, token ids, logprobs, cache facts, engine times) and exactly one Usage at the end;
closing the iterator early aborts every choice in the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tokenway.engine.client import AsyncEngine
from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.replicas import LocalReplica

PROMPT = "The history of the printing press"


@pytest.fixture(scope="module")
def replica(llm):
    engine = AsyncEngine(core=llm.engine)
    yield LocalReplica(engine)
    engine.shutdown()


def job_of(replica, params: SamplingParams, n: int = 1, text: str = PROMPT) -> GenerationJob:
    ids = replica.engine.tokenizer.encode(text, add_special_tokens=False)
    return GenerationJob("cmpl-test", "m", "completion", params, n=n, prompt=text, prompt_token_ids=tuple(ids))


async def events_of(replica, job) -> list:
    return [event async for event in replica.generate(job)]


def test_n_choices_stream_deltas_and_end_with_one_usage(replica, llm):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)
    job = job_of(replica, params, n=2)
    events = asyncio.run(events_of(replica, job))
    assert isinstance(events[-1], Usage) and not any(isinstance(e, Usage) for e in events[:-1])
    deltas = [e for e in events if isinstance(e, ChoiceDelta)]
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert [d.finish_reason for d in mine].count("length") == 1 and mine[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in mine) == 12
        assert sum(len(d.logprobs) for d in mine) == 12  # one TokenLogprob per new token
        scheduled, first, last = mine[-1].engine_times
        assert scheduled <= first <= last
    usage = events[-1]
    assert usage == Usage(len(job.prompt_token_ids), 24, usage.cached_tokens, cache_reason=usage.cache_reason)
    texts = ["".join(d.text for d in deltas if d.index == i) for i in (0, 1)]
    assert texts[0] != texts[1]  # two choices, two seeds


def test_greedy_text_is_the_offline_engines(replica, llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    job = job_of(replica, params)
    deltas = [e for e in asyncio.run(events_of(replica, job)) if isinstance(e, ChoiceDelta)]
    assert "".join(d.text for d in deltas) == replica.engine.tokenizer.decode(
        [t for d in deltas for t in d.token_ids])


def test_closing_the_iterator_aborts_every_choice(replica):
    params = SamplingParams(temperature=0.7, max_tokens=500, ignore_eos=True)

    async def main():
        stream = replica.generate(job_of(replica, params, n=3))
        async for event in stream:
            if isinstance(event, ChoiceDelta) and event.token_ids:
                break
        await stream.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while replica.stats().num_running + replica.stats().num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replica.stats().num_running == 0 and replica.stats().num_waiting == 0


def test_the_jobs_service_class_is_the_engine_requests(replica):
    def batch_tokens() -> int:
        counts = replica.stats().of_class("batch")
        assert counts is not None
        return counts.num_generated_tokens

    before = batch_tokens()
    job = dataclasses.replace(job_of(replica, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), n=2),
                              service_class="batch")
    assert isinstance(asyncio.run(events_of(replica, job))[-1], Usage)
    assert batch_tokens() == before + 6  # both choices ran as batch requests
