"""WorkerReplica against a scripted stub on loopback: the exact body it sends, and every way a
stream can fail or break the worker protocol mapped onto the error tree (tests/routing/
test_worker.py drives a real worker)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from tokenway.engine.stats import ClassStats, EngineStats
from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    InternalServerError,
    ServiceUnavailableError,
)
from tokenway.protocol.job import SERVICE_CLASSES, ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.outputs import TokenLogprob
from tokenway.protocol.sampling import SamplingParams, StructuredOutputSpec
from tokenway.routing import wire
from tokenway.routing.upstream import UpstreamTimeouts
from tokenway.routing.worker_replica import WorkerReplica

from .stub_upstream import DONE, Reply, StubUpstream, sse

SECRET = "worker-secret-for-the-tests-0123"
SECRET_ENV = "TOKENWAY_TEST_WORKER_SECRET"


@pytest.fixture(autouse=True)
def secret_env(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)


def make_job(prompt_token_ids, params: SamplingParams, n: int = 1, request_id: str = "req-1") -> GenerationJob:
    return GenerationJob(request_id, "smollm2", "completion", params, n=n, prompt_token_ids=tuple(prompt_token_ids))


@pytest.fixture()
def stub():
    with StubUpstream() as server:
        yield server


def delta(index=0, text="", token_ids=(), finish_reason=None, **fields) -> bytes:
    return sse({"index": index, "text": text, "token_ids": list(token_ids), "logprobs": None,
                "finish_reason": finish_reason, "stop_reason": None, **fields})


def usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0) -> bytes:
    return sse({"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "cached_tokens": cached_tokens}})


def stub_collect(stub: StubUpstream, job: GenerationJob, **options) -> list:
    async def main() -> list:
        async with WorkerReplica("w1", stub.base_url.removesuffix("/v1"), SECRET_ENV, **options) as replica:
            return [event async for event in replica.generate(job)]

    return asyncio.run(main())


def test_the_body_carries_every_sampling_field_and_the_secret(stub):
    stub.script(Reply(chunks=(delta(text="Hi", token_ids=[9], finish_reason="stop", stop_reason=2), usage(), DONE)))
    params = SamplingParams(temperature=0.5, top_k=4, seed=11, logit_bias={3: -5.0}, stop=("x",), max_tokens=9,
                            logprobs=1, structured_output=StructuredOutputSpec.json_schema({"type": "object"}))
    events = stub_collect(stub, make_job([1, 2, 3], params, n=1, request_id="abc"))
    assert events == [ChoiceDelta(0, text="Hi", token_ids=(9,), finish_reason="stop", stop_reason=2),
                      Usage(3, 1, counted_by="replica")]
    (received,) = stub.received
    assert (received.path, received.headers["authorization"]) == ("/worker/v1/generate", f"Bearer {SECRET}")
    assert received.body == {"request_id": "abc", "prompt_token_ids": [1, 2, 3], "n": 1,
                             "params": wire.params_to_dict(params)}
    # what the worker rebuilds from it is the same SamplingParams
    assert wire.params_from_wire(wire.GenerateBody.model_validate(received.body).params) == params


def test_interleaved_choices_keep_their_index_and_logprobs_become_token_logprobs(stub):
    entry = [5, -0.5, 1, [[5, -0.5], [6, float("-inf")]]]  # a token the grammar ruled out: -Infinity
    stub.script(Reply(chunks=(delta(index=1, text="B", token_ids=[6], logprobs=[entry]),
                              delta(index=0, text="A", token_ids=[5], finish_reason="length"),
                              delta(index=1, finish_reason="stop", stop_reason="\n"),
                              usage(3, 2, cached_tokens=16), DONE)))
    events = stub_collect(stub, make_job([1, 2, 3], SamplingParams(logprobs=1), n=2))
    assert events == [
        ChoiceDelta(1, text="B", token_ids=(6,), logprobs=(TokenLogprob(5, -0.5, 1, [(5, -0.5), (6, float("-inf"))]),)),
        ChoiceDelta(0, text="A", token_ids=(5,), finish_reason="length"),
        ChoiceDelta(1, finish_reason="stop", stop_reason="\n"),
        Usage(3, 2, cached_tokens=16, counted_by="replica"),
    ]


@pytest.mark.parametrize("chunks, error, match", [
    ((delta(text="a"), sse({"error": {"message": "x", "type": "internal_error", "code": 500}})), BadGatewayError,
     "mid-stream"),
    ((sse({"error": {"message": "x", "type": "service_unavailable", "code": 503}}),), ServiceUnavailableError, None),
    ((delta(text="a", finish_reason="abort"), usage(), DONE), BadGatewayError, "aborted"),
    ((delta(text="a"), DONE), BadGatewayError, "before every choice finished"),
    ((delta(index=1, text="a"),), BadGatewayError, "malformed"),
    ((usage(), DONE), BadGatewayError, "malformed"),  # usage before the choice finished
    ((delta(text="a", token_ids=["7"]),), BadGatewayError, "malformed"),
])
def test_a_stream_that_fails_or_breaks_the_protocol_raises(stub, chunks, error, match):
    stub.script(Reply(chunks=chunks))
    with pytest.raises(error, match=match):
        stub_collect(stub, make_job([1], SamplingParams()))


def test_a_silent_worker_times_out_and_a_job_without_token_ids_is_refused(stub):
    stub.script(Reply(chunks=(delta(text="a"),), then="hang"))
    with pytest.raises(GatewayTimeoutError):
        stub_collect(stub, make_job([1], SamplingParams()), timeouts=UpstreamTimeouts(between_events=0.2))
    assert stub.wait_for(lambda: stub.num_disconnects == 1)
    with pytest.raises(InternalServerError, match="token ids"):
        stub_collect(stub, GenerationJob("r", "m", "completion", SamplingParams(), prompt="text"))


def test_fetch_tokenizer_writes_only_the_known_file_names(stub, tmp_path):
    stub.script(Reply(status=200, headers={"content-type": "application/json"},
                      chunks=(b'{"model": "m", "files": {"tokenizer.json": "{}", "../escape.json": "x"}}',)))

    async def fetch() -> Path:
        async with WorkerReplica("w1", stub.base_url.removesuffix("/v1"), SECRET_ENV) as replica:
            return await replica.fetch_tokenizer(tmp_path / "cache")

    with pytest.raises(BadGatewayError, match="malformed tokenizer"):
        asyncio.run(fetch())
    assert not (tmp_path / "escape.json").exists() and not (tmp_path / "cache").exists()


def test_a_probe_reads_the_engines_counts_and_a_malformed_state_is_a_bad_gateway(stub):
    counts = {field.name: 1 for field in dataclasses.fields(EngineStats) if field.name != "classes"}
    classes = tuple(ClassStats(name, 1, 2, 3, 4, 5) for name in SERVICE_CLASSES)
    engine = {**counts, "classes": {entry.service_class: entry.to_dict() for entry in classes}}
    state = {"model": "m", "ready": True, "num_in_flight": 0, "kv_cache_usage": 0.5, "engine": engine}
    missing = {**state, "engine": {key: value for key, value in counts.items() if key != "num_steps"}}
    stub.script(*(Reply(headers={"content-type": "application/json"}, chunks=(json.dumps(body).encode(),))
                  for body in (state, missing)))

    async def main() -> tuple[EngineStats | None, EngineStats | None, EngineStats | None]:
        async with WorkerReplica("w1", stub.base_url.removesuffix("/v1"), SECRET_ENV) as replica:
            before = replica.stats()
            assert await replica.probe() is True
            read = replica.stats()
            with pytest.raises(BadGatewayError, match=r"malformed state \(engine: num_steps: missing\)"):
                await replica.probe()
            return before, read, replica.stats()

    before, read, after = asyncio.run(main())
    assert before is None and read == EngineStats(**counts, classes=classes)
    assert after is read  # a malformed state leaves the last good counts


def test_a_job_of_another_class_than_default_says_so_and_a_default_one_sends_nothing_new(stub):
    stub.script(*(Reply(chunks=(delta(text="Hi", token_ids=[9], finish_reason="stop"), usage(), DONE))
                  for _ in range(2)))
    params = SamplingParams(max_tokens=4)
    stub_collect(stub, dataclasses.replace(make_job([1, 2, 3], params), service_class="batch"))
    stub_collect(stub, make_job([1, 2, 3], params))
    batch, default = stub.received
    assert batch.body["service_class"] == "batch" and "service_class" not in default.body  # an older worker takes it
    assert [wire.GenerateBody.model_validate(r.body).service_class for r in stub.received] == ["batch", "default"]
