"""`tokenway worker` and WorkerReplica, the gateway's client for it: real worker processes on
loopback (started as a user starts them, with a secret file), running the model in float32 as
the session's `llm` does, so greedy output can be compared token for token. The protocol's
failure cases are in test_worker_replica.py (a scripted stub) and tests/server/test_worker_api.py
(the app on an engine made to fail)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest

from tokenway.cli import main as cli_main
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.protocol.errors import BadGatewayError, InvalidRequestError
from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.outputs import TokenLogprob
from tokenway.protocol.sampling import SamplingParams, StructuredOutputSpec
from tokenway.routing import wire
from tokenway.routing.upstream_errors import is_replica_fault
from tokenway.routing.worker_replica import WorkerReplica, replica_stats

REPO = Path(__file__).resolve().parents[2]
SECRET = "worker-secret-for-the-tests-0123"
SECRET_ENV = "TOKENWAY_TEST_WORKER_SECRET"
LONG_PROMPT = ("A worker serves one engine to gateways on other hosts; the gateway templates, parses tools and "
               "bills, and the worker only runs the token ids it is sent, reporting its load.")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`tokenway worker` in its own session (so teardown can reach its engine process too)."""

    def __init__(self, secret_file: Path, port: int | None = None) -> None:
        self.secret_file = secret_file
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = secret_file.parent / f"worker-{self.port}.log"
        env = {name: value for name, value in os.environ.items() if name != "TOKENWAY_WORKER_SECRET"}
        self.log = open(self.log_path, "w")  # noqa: SIM115  (held for the worker's life: stop() closes it)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokenway.cli", "worker", "--port", str(self.port),
             "--secret-file", str(secret_file),
             # The session `llm`'s engine settings: greedy tokens then match it exactly.
             "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--dtype", "float32", "--quantization", "none",
             "--max-num-batched-tokens", "256"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO,
            start_new_session=True)

    def wait_ready(self) -> Worker:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"worker did not become ready:\n{self.log_path.read_text()}")

    def state(self) -> dict:
        return httpx.get(f"{self.base_url}/worker/v1/state", headers={"authorization": f"Bearer {SECRET}"},
                         timeout=5).json()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            self.kill()

    def kill(self) -> None:
        """Whatever of its session is left (the engine process of a SIGKILLed worker)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("worker") / "secret"
    path.write_text(SECRET + "\n")
    return path


@pytest.fixture(scope="module")
def workers(default_model_dir, secret_file):
    """Two workers loading side by side (much of a start is single-threaded imports): one for
    the module, one for the test that kills it."""
    started = [Worker(secret_file), Worker(secret_file)]
    try:
        yield [worker.wait_ready() for worker in started]
    finally:
        for worker in started:
            worker.kill()


@pytest.fixture(scope="module")
def worker(workers):
    worker = workers[0]
    yield worker
    assert worker.stop() == 0, worker.log_path.read_text()[-3000:]  # SIGTERM: a graceful exit
    assert "tokenway: worker stopped" in worker.log_path.read_text()


@pytest.fixture(autouse=True)
def secret_env(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)


def make_job(prompt_token_ids, params: SamplingParams, n: int = 1, request_id: str = "req-1") -> GenerationJob:
    return GenerationJob(request_id, "smollm2", "completion", params, n=n,
                         prompt_token_ids=None if prompt_token_ids is None else tuple(prompt_token_ids))


def collect(base_url: str, job: GenerationJob, secret_env: str | None = SECRET_ENV) -> list:
    async def main() -> list:
        async with WorkerReplica("w1", base_url, secret_env) as replica:
            return [event async for event in replica.generate(job)]

    return asyncio.run(main())


def joined(events: list, index: int = 0) -> tuple[str, list[int], list[ChoiceDelta]]:
    deltas = [e for e in events if isinstance(e, ChoiceDelta) and e.index == index]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas


# ---- a real worker --------------------------------------------------------------------------------


def test_greedy_tokens_text_and_logprobs_equal_the_in_process_engine(worker, llm):
    prompt_ids = llm.tokenizer.encode(LONG_PROMPT)
    assert len(prompt_ids) >= 32  # two full blocks, so the second call hits the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    expected = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]

    events = collect(worker.base_url, make_job(prompt_ids, params))
    text, token_ids, deltas = joined(events)
    assert token_ids == expected.token_ids and text == expected.text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    logprobs = [entry for d in deltas for entry in d.logprobs]
    assert all(isinstance(entry, TokenLogprob) for entry in logprobs)
    assert [entry.token_id for entry in logprobs] == token_ids and all(len(entry.top) == 2 for entry in logprobs)
    for got, want in zip(logprobs, expected.logprobs):
        assert got.rank == want.rank and [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
    assert events[-1] == Usage(len(prompt_ids), 8, cached_tokens=0, counted_by="replica", cache_reason="not_cached")

    again = collect(worker.base_url, make_job(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1)))
    assert joined(again)[1] == token_ids[:1]
    num_cached_tokens = (len(prompt_ids) - 1) // 16 * 16  # the prompt's full blocks before its last token
    assert (again[-1].cached_tokens, again[-1].cache_reason) == (num_cached_tokens, "hit")
    assert [(d.num_cached_tokens, d.cache_reason) for d in again[:-1]] == [(num_cached_tokens, "hit")]
    assert worker.state()["engine"]["prefix_cache_hit_tokens"] >= again[-1].cached_tokens


def test_n_choices_run_as_engine_requests_with_choice_params_seeds(worker, llm):
    prompt_ids = llm.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    events = collect(worker.base_url, make_job(prompt_ids, params, n=2))
    first, second = joined(events, 0), joined(events, 1)
    assert len(first[1]) == len(second[1]) == 6 and first[1] != second[1]
    assert first[2][-1].finish_reason == second[2][-1].finish_reason == "length"
    assert events[-1] == Usage(len(prompt_ids), 12, cached_tokens=0, counted_by="replica",
                               cache_reason="no_full_block")
    # choice i runs with seed + i, and a seeded choice repeats
    assert joined(collect(worker.base_url, make_job(prompt_ids, SamplingParams(
        temperature=1.0, seed=8, max_tokens=6, ignore_eos=True))))[1] == second[1]


def test_calls_with_the_same_request_id_at_once_both_complete(worker, llm):
    """A gateway's request_id may come again while the first is still in the engine (a retry):
    the worker's engine ids keep them apart."""
    prompt_ids = llm.tokenizer.encode("The sky is")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main() -> list:
        async with WorkerReplica("w1", worker.base_url, SECRET_ENV) as replica:
            async def one() -> list:
                return [event async for event in replica.generate(make_job(prompt_ids, params, request_id="same"))]

            return await asyncio.wait_for(asyncio.gather(one(), one()), 120)

    first, second = asyncio.run(main())
    assert joined(first)[1] == joined(second)[1] and len(joined(first)[1]) == 4
    assert first[-1].completion_tokens == second[-1].completion_tokens == 4


def test_stop_strings_and_structured_output_reach_the_engine(worker, llm):
    prompt_ids = llm.tokenizer.encode("The three primary colors are")
    free = joined(collect(worker.base_url, make_job(prompt_ids, SamplingParams(temperature=0.0, max_tokens=10))))[0]
    stop = free.split()[2]
    events = collect(worker.base_url,
                     make_job(prompt_ids, SamplingParams(temperature=0.0, max_tokens=10, stop=(stop,))))
    text, _, deltas = joined(events)
    assert text == free[:free.index(stop)]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)

    spec = StructuredOutputSpec.regex("[0-9]{3}-[a-z]{2}")
    constrained = collect(worker.base_url, make_job(prompt_ids, SamplingParams(
        temperature=0.0, max_tokens=16, structured_output=spec)))
    text, _, deltas = joined(constrained)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
    assert deltas[-1].finish_reason == "stop"


def test_without_the_secret_nothing_runs(worker, llm, monkeypatch):
    before = worker.state()["engine"]
    body = {"request_id": "x", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4}}
    for headers in ({}, {"authorization": "Bearer wrong-secret-of-the-same-size-01"},
                    {"authorization": f"Basic {SECRET}"}, {"authorization": SECRET}):
        response = httpx.post(f"{worker.base_url}/worker/v1/generate", json=body, headers=headers, timeout=10)
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "authentication_error"
        for path in ("state", "tokenizer", "no-such-route"):
            assert httpx.get(f"{worker.base_url}/worker/v1/{path}", headers=headers, timeout=10).status_code == 401
    assert httpx.get(f"{worker.base_url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{worker.base_url}/ready", timeout=10).status_code == 200

    monkeypatch.setenv("WRONG_SECRET", "wrong-secret-of-the-same-size-01")
    job = make_job(llm.tokenizer.encode("hi"), SamplingParams(max_tokens=4))
    with pytest.raises(BadGatewayError, match="credentials"):
        collect(worker.base_url, job, secret_env="WRONG_SECRET")

    async def probe() -> bool:
        async with WorkerReplica("w1", worker.base_url, "WRONG_SECRET") as replica:
            return await replica.probe()

    with pytest.raises(BadGatewayError):
        asyncio.run(probe())
    after = worker.state()["engine"]
    assert after["num_steps"] == before["num_steps"]
    assert after["prefix_cache_queried_tokens"] == before["prefix_cache_queried_tokens"]


def test_bad_params_and_prompts_are_400s_before_the_stream(worker):
    with pytest.raises(InvalidRequestError) as outside:
        collect(worker.base_url, make_job([1, 2, 49152 + 7], SamplingParams(max_tokens=4)))
    assert outside.value.param == "prompt_token_ids" and not is_replica_fault(outside.value)
    with pytest.raises(InvalidRequestError, match="context window") as too_long:
        collect(worker.base_url, make_job([5] * 2048, SamplingParams(max_tokens=4)))
    assert too_long.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="response_format"):
        collect(worker.base_url, make_job([5], SamplingParams(structured_output=StructuredOutputSpec(
            "grammar", grammar="start: this is not lark"))))

    headers = {"authorization": f"Bearer {SECRET}"}
    for params, param in (({"temperatur": 0.5}, "params.temperatur"), ({"top_p": 0.0}, "top_p"),
                          ({"max_tokens": "8"}, "params.max_tokens"), ({"logit_bias": {"x": 1.0}}, "logit_bias")):
        response = httpx.post(f"{worker.base_url}/worker/v1/generate", headers=headers, timeout=10,
                              json={"request_id": "x", "prompt_token_ids": [1, 2], "params": params})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    not_json = httpx.post(f"{worker.base_url}/worker/v1/generate", headers=headers, content=b"{", timeout=10)
    assert not_json.status_code == 400


def test_closing_the_stream_aborts_the_engine_requests(worker, llm):
    prompt_ids = llm.tokenizer.encode("Count slowly:")
    max_tokens = 1500
    steps_before = worker.state()["engine"]["num_steps"]

    async def read_three_then_leave(replica: WorkerReplica) -> int:
        num_deltas = 0
        job = make_job(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), n=2)
        async with aclosing(replica.generate(job)) as events:
            async for _ in events:
                num_deltas += 1
                if num_deltas == 3:
                    break
        return num_deltas

    async def main() -> int:
        async with WorkerReplica("w1", worker.base_url, SECRET_ENV) as replica:
            return await read_three_then_leave(replica)

    assert asyncio.run(main()) == 3
    give_up_at = time.monotonic() + 120
    while True:
        state = worker.state()
        if state["engine"]["num_running"] == state["engine"]["num_waiting"] == state["num_in_flight"] == 0:
            break
        assert time.monotonic() < give_up_at, state
        time.sleep(0.05)
    # Aborted, not finished: both choices together ran far fewer steps than either needed.
    assert state["engine"]["num_steps"] - steps_before < max_tokens


def test_state_probe_and_stats(worker):
    async def main():
        async with WorkerReplica("w1", worker.base_url, SECRET_ENV) as replica:
            assert (replica.kind, replica.stats()) == ("worker", None)  # nothing read yet
            probed = await replica.probe()
            return await replica.state(), probed, replica.stats()

    state, probed, stats = asyncio.run(main())
    assert probed is True
    assert (state["model"], state["max_model_len"], state["vocab_size"], state["block_size"]) == (
        "smollm2-135m-instruct", 2048, 49152, 16)
    assert state["ready"] is True and state["num_in_flight"] == 0 and 0.0 <= state["kv_cache_usage"] <= 1.0
    engine = state["engine"]
    assert {"num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_hit_rate",
            "engine_pid"} <= set(engine)
    # The worker's counts, parsed at the gateway: the same keys, order and values it sent.
    assert stats is not None and list(stats.to_dict().items()) == list(engine.items())
    balancer_view = replica_stats(state)
    assert (balancer_view.num_running, balancer_view.kv_cache_usage, balancer_view.prefix_cache_hit_rate) == (
        0, state["kv_cache_usage"], engine["prefix_cache_hit_rate"])


def test_a_jobs_service_class_reaches_the_workers_engine(worker, llm):
    prompt_ids = llm.tokenizer.encode("The sky is")
    before = worker.state()["engine"]["classes"]
    job = dataclasses.replace(make_job(prompt_ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
                              service_class="batch")
    assert isinstance(collect(worker.base_url, job)[-1], Usage)
    after = worker.state()["engine"]["classes"]  # the step that finished the call brought its counts
    assert after["batch"]["num_generated_tokens"] == before["batch"]["num_generated_tokens"] + 5
    assert after["batch"]["num_prompt_tokens"] == before["batch"]["num_prompt_tokens"] + len(prompt_ids)
    assert after["default"] == before["default"]


def test_the_fetched_tokenizer_tokenizes_and_templates_like_the_local_one(worker, default_model_dir, tmp_path):
    async def fetch() -> Path:
        async with WorkerReplica("w1", worker.base_url, SECRET_ENV) as replica:
            return await replica.fetch_tokenizer(tmp_path)

    path = asyncio.run(fetch())
    assert asyncio.run(fetch()) == path  # content-addressed: fetched again, the same directory
    assert {p.name for p in path.iterdir()} <= set(wire.TOKENIZER_FILES) and "tokenizer.json" in {
        p.name for p in path.iterdir()}
    local, remote = Tokenizer.from_dir(default_model_dir), Tokenizer.from_dir(path)
    text = "Héllo, wörld! 1234 <|im_start|> tokens"
    assert remote.encode(text) == local.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert remote.apply_chat_template(messages) == local.apply_chat_template(messages)
    assert (remote.eos_token_ids, remote.bos_token_id, remote.vocab_size) == (
        local.eos_token_ids, local.bos_token_id, local.vocab_size)


def test_a_worker_killed_mid_stream_fails_each_stream_promptly(workers, llm):
    worker = workers[1]
    try:
        engine_pid = worker.state()["engine"]["engine_pid"]
        prompt_ids = llm.tokenizer.encode("Tell me a long story about a lighthouse.")

        async def stream(replica: WorkerReplica, index: int, started: asyncio.Event) -> BaseException | None:
            job = make_job(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True),
                           request_id=f"kill-{index}")
            try:
                async for _ in replica.generate(job):
                    started.set()
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                return exc
            return None

        async def main() -> list:
            async with WorkerReplica("w1", worker.base_url, SECRET_ENV) as replica:
                started = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(stream(replica, i, event)) for i, event in enumerate(started)]
                await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
                os.kill(worker.process.pid, signal.SIGKILL)
                # Only a bound to fail rather than hang: the streams end as the connections close.
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                with pytest.raises(BadGatewayError):
                    await replica.probe()
                return outcomes

        outcomes = asyncio.run(main())
        assert all(isinstance(outcome, BadGatewayError) and is_replica_fault(outcome) for outcome in outcomes), outcomes
        # The engine process sees its parent's pipe close and exits too.
        give_up_at = time.monotonic() + 60
        while _is_running(engine_pid):
            assert time.monotonic() < give_up_at, "the engine process outlived its worker"
            time.sleep(0.1)
    finally:
        worker.kill()


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_no_secret_refuses_a_non_loopback_host_before_loading(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("TOKENWAY_WORKER_SECRET", raising=False)
    assert cli_main(["worker", "--host", "0.0.0.0", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "0.0.0.0 is reachable from other machines" in capsys.readouterr().err
    short = tmp_path / "short"
    short.write_text("abc\n")
    assert cli_main(["worker", "--secret-file", str(short)]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
