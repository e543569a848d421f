"""Issue 5 end to end: every call's trace, /metrics, the prefix-cache story, `tokenway trace`."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenway.stages import STAGES

from .conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret-for-observability-tests"
LONG_SYSTEM = " ".join(f"Rule {i}: answer briefly and politely." for i in range(20))


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = Server("--admin-key", ADMIN)
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def key(server) -> str:
    """An API key: with an admin key set, auth is on from the start."""
    from .test_gateway_policy import create_key

    key = create_key(server.db, "--name", "observer")
    deadline = time.monotonic() + 10  # the server sees the new key within ~2 s
    while httpx.get(f"{server.base_url}/v1/models", headers=bearer(key), timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return key


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def admin_trace(server: Server, request_id: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}/admin/traces/{request_id}", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=10)


def wait_for_trace(server: Server, request_id: str, timeout: float = 10.0) -> dict:
    """The trace is recorded once the last byte is out: right after the client has it."""
    deadline = time.monotonic() + timeout
    while True:
        response = admin_trace(server, request_id)
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.05)


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    response = httpx.get(server.base_url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_completed_call_has_a_trace_whose_stages_add_up(server, key):
    started = time.monotonic()
    raw = client(server, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0)
    elapsed_ms = (time.monotonic() - started) * 1000
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id
    trace = wait_for_trace(server, completion.id)

    assert list(trace["stages_ms"]) == list(STAGES)
    assert abs(sum(trace["stages_ms"].values()) - trace["total_ms"]) < 1.0
    assert 0 < trace["total_ms"] <= elapsed_ms
    for stage in ("tokenize", "prefill"):
        assert trace["stages_ms"][stage] > 0, stage
    usage = completion.usage
    assert (trace["prompt_tokens"], trace["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert trace["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert trace["finish_reason"] == completion.choices[0].finish_reason
    assert trace["status"] == 200 and trace["endpoint"] == "/v1/chat/completions"
    assert 0 < trace["ttft_ms"] < trace["total_ms"]
    if usage.completion_tokens > 1:
        assert trace["tpot_ms"] > 0
    assert trace["sampling"]["max_tokens"] == 8 and trace["sampling"]["temperature"] == 0

    # A key sees its own traces on /v1.
    own = httpx.get(f"{server.base_url}/v1/traces/{completion.id}", headers=bearer(key), timeout=10)
    assert own.status_code == 200 and own.json()["request_id"] == completion.id
    missing = httpx.get(f"{server.base_url}/v1/traces/chatcmpl-nope", headers=bearer(key), timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "trace_not_found"


def test_a_stream_and_an_anthropic_call_are_traced_too(server, key):
    stream = client(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, temperature=0,
        stream=True)
    chunk_ids = {chunk.id for chunk in stream}
    (request_id,) = chunk_ids
    trace = wait_for_trace(server, request_id)
    assert trace["stream"] is True and trace["status"] == 200 and trace["stages_ms"]["decode"] >= 0

    response = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": key}, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    message_id = response.json()["id"]
    assert response.headers["request-id"] == message_id
    assert wait_for_trace(server, message_id)["endpoint"] == "/v1/messages"


def test_metrics_appear_and_move_after_requests(server, key):
    before = scrape(server)
    completion = client(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes."}], max_tokens=5, temperature=0)
    wait_for_trace(server, completion.id)
    after = scrape(server)
    labels = {"model": MODEL, "endpoint": "/v1/chat/completions", "status": "200",
              "finish_reason": completion.choices[0].finish_reason}
    assert value(after, "tokenway_requests_total", **labels) == value(before, "tokenway_requests_total", **labels) + 1
    for name, amount in (("tokenway_prompt_tokens_total", completion.usage.prompt_tokens),
                         ("tokenway_completion_tokens_total", completion.usage.completion_tokens)):
        assert value(after, name, model=MODEL) == value(before, name, model=MODEL) + amount, name
    for histogram in ("tokenway_time_to_first_token_seconds", "tokenway_e2e_request_latency_seconds",
                      "tokenway_request_queue_time_seconds", "tokenway_request_prefill_time_seconds"):
        count = histogram + "_count"
        assert value(after, count, model=MODEL) == value(before, count, model=MODEL) + 1, histogram
    for stage in STAGES:
        count = "tokenway_stage_duration_seconds_count"
        assert value(after, count, stage=stage) == value(before, count, stage=stage) + 1, stage
    if completion.usage.completion_tokens > 2:
        assert value(after, "tokenway_inter_token_latency_seconds_count", model=MODEL) > \
            value(before, "tokenway_inter_token_latency_seconds_count", model=MODEL)
    assert value(after, "tokenway_kv_cache_blocks_total") > 0
    assert value(after, "tokenway_requests_running") == 0 and value(after, "tokenway_requests_waiting") == 0
    assert value(after, "tokenway_prefix_cache_queried_tokens_total") >= \
        value(before, "tokenway_prefix_cache_queried_tokens_total") + completion.usage.prompt_tokens
    assert 0.0 <= value(after, "tokenway_prefix_cache_hit_ratio") <= 1.0


def test_the_trace_says_why_the_prefix_cache_missed(server, key):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is 2+2?"}]
    first = client(server, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client(server, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cold, warm = wait_for_trace(server, first.id), wait_for_trace(server, second.id)
    assert cold["cache_reason"] == "not_cached" and cold["cached_tokens"] == 0
    assert "never cached" in cold["cache_explanation"]
    assert warm["cache_reason"] == "hit"
    assert warm["cached_tokens"] == second.usage.prompt_tokens_details.cached_tokens > 0
    assert warm["cache_explanation"].startswith(f"{warm['cached_tokens']} of {warm['prompt_tokens']}")

    short = client(server, key).completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0)
    assert wait_for_trace(server, short.id)["cache_reason"] == "no_full_block"


def test_a_cancelled_stream_leaves_a_trace(server, key):
    before = scrape(server)
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers=bearer(key), timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}) as response:
        request_id = response.headers["x-request-id"]
        num_chunks = 0
        for line in response.iter_lines():
            num_chunks += line.startswith("data: ")
            if num_chunks == 3:
                break  # the role chunk and two tokens, then hang up
    trace = wait_for_trace(server, request_id)
    assert trace["status"] == 499 and trace["error"] == "client disconnected"
    assert 0 < trace["completion_tokens"] < 400
    assert abs(sum(trace["stages_ms"].values()) - trace["total_ms"]) < 1.0
    after = scrape(server)
    assert value(after, "tokenway_client_disconnects_total", model=MODEL) == \
        value(before, "tokenway_client_disconnects_total", model=MODEL) + 1


def test_a_429_leaves_a_trace_with_its_limit(server):
    from .test_gateway_policy import create_key

    key = create_key(server.db, "--name", "one-per-minute", "--rpm", "1")
    deadline = time.monotonic() + 10  # the server sees the new key within ~2 s (/v1/models counts to no limit)
    while httpx.get(f"{server.base_url}/v1/models", headers=bearer(key), timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    before = scrape(server)
    ok = client(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        client(server, key).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1)
    request_id = refused.value.response.headers["x-request-id"]
    trace = wait_for_trace(server, request_id)
    assert trace["status"] == 429 and trace["limit_kind"] == "requests"
    assert trace["stages_ms"]["limits"] > 0 and trace["stages_ms"]["queue"] == trace["stages_ms"]["decode"] == 0
    assert trace["key_id"] == wait_for_trace(server, ok.id)["key_id"] != "anonymous"
    assert value(scrape(server), "tokenway_rate_limited_total", kind="requests") == \
        value(before, "tokenway_rate_limited_total", kind="requests") + 1

    # A key sees its own traces on /v1, not others'; the admin sees all.
    mine = httpx.get(f"{server.base_url}/v1/traces/{ok.id}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert mine.status_code == 200
    other = create_key(server.db, "--name", "nosy")
    time.sleep(2.5)  # the key cache refreshes every 2 s
    theirs = httpx.get(f"{server.base_url}/v1/traces/{ok.id}", headers={"Authorization": f"Bearer {other}"},
                       timeout=10)
    assert theirs.status_code == 404
    assert httpx.get(f"{server.base_url}/admin/traces/{ok.id}", timeout=10).status_code == 401
    assert httpx.get(f"{server.base_url}/dashboard/api/snapshot", timeout=10).status_code == 401


def test_tokenway_trace_prints_the_waterfall_and_the_summary(server):
    from .test_gateway_policy import create_key

    key = create_key(server.db, "--name", "trace-cli")
    deadline = time.monotonic() + 10  # the server sees the new key within ~2 s
    while True:
        try:
            completion = client(server, key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=4, temperature=0)
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    wait_for_trace(server, completion.id)

    def trace_cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "tokenway.cli", "trace", *args], capture_output=True, text=True,
                             cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    table = trace_cli(completion.id, "--url", server.base_url, "--admin-key", ADMIN)
    assert completion.id in table
    rows = [line for line in table.splitlines() if line.split(" ")[0] in STAGES]
    assert [row.split()[0] for row in rows] == list(STAGES)
    shares = [float(row.split()[2].rstrip("%")) for row in rows]
    assert abs(sum(shares) - 100.0) < 1.0

    summary = trace_cli("--summary", "--url", server.base_url, "--admin-key", ADMIN)
    assert "where the time went" in summary and all(stage in summary for stage in STAGES)

    # The server down (or having forgotten): the ledger still has the request's stages.
    from_ledger = trace_cli(completion.id, "--url", "http://127.0.0.1:9", "--db", str(server.db))
    assert completion.id in from_ledger and "prefill" in from_ledger
    missing = subprocess.run([sys.executable, "-m", "tokenway.cli", "trace", "chatcmpl-none", "--url",
                              "http://127.0.0.1:9", "--db", str(server.db)], capture_output=True, text=True,
                             cwd=REPO, timeout=60)
    assert missing.returncode == 1 and "no trace" in missing.stderr


def test_spans_reach_an_otlp_collector_with_the_callers_trace_context(default_model_dir):
    from ..observability.test_otel import Receiver, attributes

    receiver = Receiver()
    otel_server = Server("--otlp-endpoint", receiver.endpoint)
    try:
        parent_trace_id, parent_span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        response = httpx.post(f"{otel_server.base_url}/v1/chat/completions", timeout=60,
                              headers={"traceparent": f"00-{parent_trace_id}-{parent_span_id}-01"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert response.status_code == 200
        request_id = response.json()["id"]
    finally:
        assert otel_server.stop() == 0  # shutdown flushes the span queue
        receiver.stop()
    roots = [s for s in receiver.by_name(f"chat {MODEL}") if attributes(s)["gen_ai.response.id"] == request_id]
    assert len(roots) == 1
    root = roots[0]
    assert root.trace_id.hex() == parent_trace_id and root.parent_span_id.hex() == parent_span_id
    attrs = attributes(root)
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.usage.output_tokens"] == response.json()["usage"]["completion_tokens"]
    stage_spans = [s for s in receiver.spans if s.parent_span_id == root.span_id]
    assert {s.name for s in stage_spans} >= {"tokenway.tokenize", "tokenway.prefill"}
    assert sum(s.end_time_unix_nano - s.start_time_unix_nano for s in stage_spans) == \
        root.end_time_unix_nano - root.start_time_unix_nano
