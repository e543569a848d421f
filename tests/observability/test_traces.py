import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenway.engine.stats import EngineStats
from tokenway.gateway.call import Call, CallOutcome, CallStart, RouteChoice
from tokenway.observability.metrics import Metrics
from tokenway.observability.observer import Observer
from tokenway.observability.traces import Trace, TraceRing, render_summary, render_waterfall, summarize
from tokenway.protocol.job import GenerationJob
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.router import ReplicaChoice
from tokenway.server.stats import ServerStats
from tokenway.stages import STAGES, StageClock

ENGINE = EngineStats(num_running=2, num_waiting=1, kv_blocks_total=100, kv_blocks_free=75, prefix_cache_hit_rate=0.25,
                     prefix_cache_queried_tokens=400, prefix_cache_hit_tokens=100, num_preemptions=4, num_steps=50,
                     spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0,
                     spec_decode_acceptance_rate=0.0, spec_decode_mean_accepted_length=0.0)
ENGINE_STATS = ServerStats(ENGINE, num_pending_http=3, replicas={})  # a local engine, no other replica


def make_trace(request_id: str = "chatcmpl-1", status: int = 200, total_ms: float = 100.0, **fields) -> Trace:
    stages_ms = dict.fromkeys(STAGES, 0.0)
    stages_ms.update({"auth": 1.0, "tokenize": 4.0, "queue": 5.0, "prefill": 20.0, "decode": 70.0})
    stages_ms = {k: v * total_ms / 100.0 for k, v in stages_ms.items()}
    defaults = dict(endpoint="/v1/chat/completions", model="m", key_id="k", started_at=1.0e9, ttft_ms=30.0,
                    tpot_ms=7.0, prompt_tokens=40, cached_tokens=32, completion_tokens=11, finish_reason="stop",
                    cost_usd=0.002, cache_reason="hit")
    defaults.update(fields)
    return Trace(request_id=request_id, status=status, stages_ms=stages_ms, total_ms=total_ms, **defaults)


def test_trace_of_a_call_takes_the_clock_the_job_and_the_outcome():
    clock = StageClock(received=10.0)
    for stage, at in (("auth", 10.001), ("validation", 10.002), ("routing", 10.003), ("tokenize", 10.005),
                      ("limits", 10.006), ("queue", 10.010), ("prefill", 10.050), ("decode", 10.150),
                      ("postprocess", 10.151)):
        clock.end(stage, at)
    clock.billing_started, clock.done = 10.152, 10.153
    call = Call(CallStart.now("/v1/completions"), clock)
    call.set_route(RouteChoice(model="m", pool="m"))
    call.set_replica(ReplicaChoice("m", "local", "only"))
    call.set_job(GenerationJob("cmpl-1", "m", "completion", SamplingParams(max_tokens=11, seed=7), n=2,
                               prompt_token_ids=tuple(range(20)), stream=True))
    outcome = CallOutcome(200, prompt_tokens=20, completion_tokens=22, reasoning_tokens=9, max_choice_tokens=11,
                          finish_reason="length", cache_reason="not_cached")
    trace = Trace.of_call(call, outcome, cost_usd=0.5)
    assert trace.reasoning_tokens == 9
    assert trace.request_id == "cmpl-1" and trace.model == "m" and trace.cost_usd == 0.5
    assert trace.total_ms == pytest.approx(153.0)
    assert trace.ttft_ms == pytest.approx(50.0)
    assert trace.tpot_ms == pytest.approx(10.0)  # 100 ms of decode over tokens 2..11 of the longest choice
    assert trace.status == 200 and trace.endpoint == "/v1/completions"
    assert trace.stream and trace.num_choices == 2 and trace.sampling["max_tokens"] == 11
    assert trace.route == {"pool": "m", "replica": "local", "reason": "only", "failed_attempts": 0}
    assert Trace.of_call(call, CallOutcome(499, error="client disconnected"), 0.0).status == 499
    data = trace.to_dict()
    assert data["cache_explanation"].startswith("0 of 20 prompt tokens cached; the first block")
    assert Trace.from_dict(data) == trace


def test_a_calls_facts_are_set_once():
    call = Call(CallStart.now("/v1/chat/completions"))
    call.set_route(RouteChoice(model="m", pool="m"))
    with pytest.raises(AssertionError):
        call.set_route(RouteChoice(model="n", pool="n"))
    call.end(CallOutcome(400, error="bad"))
    call.end(CallOutcome(200))  # the first outcome stands: a later report (the middleware's fallback) is ignored
    assert call.outcome.status == 400 and call.request_id.startswith("req_")


def test_ring_keeps_the_newest_and_finds_by_id():
    ring = TraceRing(capacity=3)
    for i in range(5):
        ring.add(make_trace(f"r{i}"))
    assert len(ring) == 3
    assert ring.get("r0") is None and ring.get("r4").request_id == "r4"
    assert [t.request_id for t in ring.recent(10)] == ["r4", "r3", "r2"]
    assert [t.request_id for t in ring.recent(2)] == ["r4", "r3"]
    with pytest.raises(ValueError):
        TraceRing(capacity=0)


def test_summary_shares_are_of_completed_calls_and_add_up_to_one():
    traces = [make_trace(f"r{i}", total_ms=100.0 * (i + 1)) for i in range(4)] + [make_trace("x", status=429)]
    summary = summarize(traces)
    assert summary["num_requests"] == 5 and summary["num_completed"] == 4
    assert sum(row["share"] for row in summary["stages"].values()) == pytest.approx(1.0)
    assert summary["stages"]["decode"]["share"] == pytest.approx(0.70)
    assert summary["stages"]["decode"]["mean_ms"] == pytest.approx(175.0)
    assert summary["total"]["p50_ms"] == pytest.approx(300.0)
    table = render_summary(summary)
    assert all(stage in table for stage in STAGES)
    assert summarize([])["stages"]["auth"]["share"] == 0.0  # nothing yet: zeros, not an error


def test_waterfall_table_lists_every_stage_with_its_share():
    table = render_waterfall(make_trace(reasoning_tokens=6).to_dict())
    assert "completion=11 (reasoning=6)" in table
    lines = {line.split()[0]: line for line in table.splitlines() if line and line.split()[0] in STAGES}
    assert list(lines) == list(STAGES)
    assert "70.0%" in lines["decode"] and "#" in lines["decode"]
    assert "32 of 40 prompt tokens cached" in table


def scrape(metrics: Metrics) -> dict:
    samples = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_follow_prometheus_naming_and_count_each_call_once():
    metrics = Metrics(lambda: ENGINE_STATS, lambda: {"num_rows_written": 7, "num_rows_quarantined": 1})
    metrics.observe(make_trace(reasoning_tokens=5))
    metrics.observe(make_trace("r2", status=429, limit_kind="tokens", ttft_ms=None, tpot_ms=None,
                               completion_tokens=0, finish_reason=None, cost_usd=0.0, cache_reason=None))
    metrics.observe(make_trace("r3", status=499, finish_reason=None))
    s = scrape(metrics)
    ok = (("endpoint", "/v1/chat/completions"), ("finish_reason", "stop"), ("model", "m"), ("status", "200"))
    assert s[("tokenway_requests_total", ok)] == 1
    assert s[("tokenway_rate_limited_total", (("kind", "tokens"),))] == 1
    assert s[("tokenway_client_disconnects_total", (("model", "m"),))] == 1
    assert s[("tokenway_completion_tokens_total", (("model", "m"),))] == 22
    assert s[("tokenway_reasoning_tokens_total", (("model", "m"),))] == 5
    assert s[("tokenway_cost_usd_total", (("model", "m"),))] == pytest.approx(0.004)
    assert s[("tokenway_time_to_first_token_seconds_count", (("model", "m"),))] == 2
    assert s[("tokenway_time_to_first_token_seconds_sum", (("model", "m"),))] == pytest.approx(0.06)
    assert s[("tokenway_stage_duration_seconds_count", (("stage", "billing"),))] == 3
    assert s[("tokenway_prefix_cache_lookups_total", (("outcome", "hit"),))] == 2
    # Engine gauges, read at scrape time.
    assert s[("tokenway_kv_cache_blocks_used", ())] == 25
    assert s[("tokenway_kv_cache_usage_ratio", ())] == 0.25
    assert s[("tokenway_requests_waiting", ())] == 1
    assert s[("tokenway_prefix_cache_hit_tokens_total", ())] == 100
    assert s[("tokenway_preemptions_total", ())] == 4
    # The ledger's writer, read at scrape time too.
    assert s[("tokenway_ledger_rows_written_total", ())] == 7
    assert s[("tokenway_ledger_quarantined_rows_total", ())] == 1
    # Ours are all under tokenway_; beside them only the process's own (memory, CPU, fds).
    assert all(name.startswith(("tokenway_", "process_", "python_")) for name, _ in s)
    assert any(name == "process_resident_memory_bytes" for name, _ in s)


def test_observer_samples_throughput_once_per_interval():
    clock = [100.0]
    observer = Observer(lambda: ENGINE_STATS, now=lambda: clock[0])
    observer.maybe_sample()  # the first call only sets the baseline
    clock[0] = 100.5  # within the interval: activity takes no sample
    observer.on_tokens("m", 50, 0.02)
    observer.record(make_trace())
    assert not observer.samples
    clock[0] = 102.0
    observer.maybe_sample()
    (point,) = observer.samples
    assert point["tokens_per_s"] == pytest.approx(25.0) and point["requests_per_s"] == pytest.approx(0.5)
    assert point["kv_usage"] == 0.25 and point["running"] == 2
    snapshot = observer.snapshot(limit=10)
    assert snapshot["stages"] == list(STAGES)
    assert [t["request_id"] for t in snapshot["traces"]] == ["chatcmpl-1"]
    assert snapshot["summary"]["num_completed"] == 1
    assert snapshot["engine"] == {**ENGINE.to_dict(), "num_pending_http": 3}
