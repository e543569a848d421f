"""Replicas made visible to operators: tokenway_replica_* read from the server's stats at
scrape time, tokenway_routed_* labelled by the replica a call's Trace names, and the dashboard's
snapshot carrying both, with a local engine and without one (a pure gateway)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenway.gateway.call import Call, CallOutcome, CallStart, RouteChoice
from tokenway.observability.metrics import Metrics
from tokenway.observability.observer import Observer
from tokenway.observability.traces import Trace
from tokenway.protocol.job import GenerationJob
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.router import ReplicaChoice
from tokenway.server.stats import ServerStats
from tokenway.stages import StageClock

from .test_traces import ENGINE, ENGINE_STATS, make_trace


def replica(kind: str, available: bool = True, unavailable_reason: str | None = None, num_in_flight: int = 0,
            num_outstanding_tokens: int = 0, num_calls: int = 0, num_failures: int = 0, prompt_tokens: int = 0,
            cached_tokens: int = 0, completion_tokens: int = 0) -> dict:
    """One replica as Router.stats gives it."""
    return {"kind": kind, "available": available, "unavailable_reason": unavailable_reason,
            "num_in_flight": num_in_flight, "num_outstanding_tokens": num_outstanding_tokens, "num_calls": num_calls,
            "num_failures": num_failures, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "completion_tokens": completion_tokens,
            "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None}


REPLICAS = {
    "small": {"local": replica("engine", num_in_flight=2, num_outstanding_tokens=900, num_calls=10,
                               prompt_tokens=400, cached_tokens=100, completion_tokens=50)},
    "pair": {"w1": replica("worker", num_in_flight=1, num_outstanding_tokens=300, num_calls=7, num_failures=1,
                           prompt_tokens=70, completion_tokens=30),
             "w2": replica("worker", available=False, unavailable_reason="breaker open", num_calls=3,
                           num_failures=3)},
}
ENGINE_SERVER_STATS = dataclasses.replace(ENGINE_STATS, replicas=REPLICAS)
GATEWAY_STATS = ServerStats(None, num_pending_http=1, replicas={
    "remote": {"oa": replica("openai", num_in_flight=4, num_calls=20, prompt_tokens=1000, cached_tokens=600),
               "an": replica("anthropic", available=False, unavailable_reason="probe failed")}})
ENGINE_FAMILIES = {"tokenway_requests_running", "tokenway_requests_waiting", "tokenway_kv_cache_blocks_used",
                   "tokenway_kv_cache_blocks_total", "tokenway_kv_cache_usage_ratio", "tokenway_prefix_cache_hit_ratio",
                   "tokenway_prefix_cache_queried_tokens", "tokenway_prefix_cache_hit_tokens", "tokenway_preemptions",
                   "tokenway_interjected_steps",
                   "tokenway_spec_decode_num_drafts", "tokenway_spec_decode_num_draft_tokens",
                   "tokenway_spec_decode_num_accepted_tokens", "tokenway_spec_decode_acceptance_ratio"}


def scrape(metrics: Metrics) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """(family name -> its type, {(sample name, sorted labels): value}) of the exposition."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, samples


def at(pool: str, replica: str, **labels: str) -> tuple:
    return tuple(sorted({"pool": pool, "replica": replica, **labels}.items()))


def test_each_replica_has_its_health_load_and_tallies_with_a_local_engine():
    types, s = scrape(Metrics(lambda: ENGINE_SERVER_STATS))
    assert s[("tokenway_replica_up", at("small", "local", kind="engine"))] == 1
    assert s[("tokenway_replica_up", at("pair", "w1", kind="worker"))] == 1
    assert s[("tokenway_replica_up", at("pair", "w2", kind="worker"))] == 0  # breaker open
    assert s[("tokenway_replica_in_flight", at("small", "local"))] == 2
    assert s[("tokenway_replica_outstanding_tokens", at("pair", "w1"))] == 300
    assert s[("tokenway_replica_calls_total", at("pair", "w1"))] == 7
    assert s[("tokenway_replica_failures_total", at("pair", "w2"))] == 3
    assert s[("tokenway_replica_prompt_tokens_total", at("small", "local"))] == 400
    assert s[("tokenway_replica_cached_prompt_tokens_total", at("small", "local"))] == 100
    assert s[("tokenway_replica_completion_tokens_total", at("pair", "w1"))] == 30
    assert s[("tokenway_replica_prefix_cache_hit_ratio", at("small", "local"))] == 0.25
    assert s[("tokenway_replica_prefix_cache_hit_ratio", at("pair", "w1"))] == 0.0
    # No usage reported yet: no ratio at all rather than a made-up 0.
    assert ("tokenway_replica_prefix_cache_hit_ratio", at("pair", "w2")) not in s
    # One series per replica: the label sets are the configured replicas, nothing else.
    assert {labels for name, labels in s if name == "tokenway_replica_calls_total"} == \
        {at("small", "local"), at("pair", "w1"), at("pair", "w2")}
    for name in ("calls", "failures", "prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
        assert types[f"tokenway_replica_{name}"] == "counter", name
    for name in ("up", "in_flight", "outstanding_tokens", "prefix_cache_hit_ratio"):
        assert types[f"tokenway_replica_{name}"] == "gauge", name
    # The engine's own gauges are still there beside them.
    assert set(types) >= ENGINE_FAMILIES
    assert s[("tokenway_kv_cache_blocks_used", ())] == 25


def test_without_a_local_engine_there_are_no_engine_gauges_and_the_replicas_still_show():
    types, s = scrape(Metrics(lambda: GATEWAY_STATS))
    assert not ENGINE_FAMILIES & set(types)
    assert s[("tokenway_replica_up", at("remote", "oa", kind="openai"))] == 1
    assert s[("tokenway_replica_up", at("remote", "an", kind="anthropic"))] == 0
    assert s[("tokenway_replica_in_flight", at("remote", "oa"))] == 4
    assert s[("tokenway_replica_prefix_cache_hit_ratio", at("remote", "oa"))] == 0.6


def test_no_replicas_no_replica_series():
    types, s = scrape(Metrics(lambda: ENGINE_STATS))  # a local engine, no replicas (no router's pools)
    assert "tokenway_replica_up" in types  # the family is declared, with no samples
    assert not any(name.startswith("tokenway_replica_") for name, _ in s)


STAGE_ENDS = (("auth", 10.001), ("validation", 10.002), ("routing", 10.003), ("tokenize", 10.005), ("limits", 10.006),
              ("queue", 10.010), ("prefill", 10.050), ("decode", 10.150), ("postprocess", 10.151))


def finished_call(choice: ReplicaChoice | None, outcome: CallOutcome, num_stages: int = len(STAGE_ENDS)) -> Trace:
    """The trace of a call that ran 50 ms to its first token and 100 ms more to its 11th (or
    stopped after its first num_stages stages)."""
    clock = StageClock(received=10.0)
    for stage, t in STAGE_ENDS[:num_stages]:
        clock.end(stage, t)
    clock.billing_started, clock.done = 10.152, 10.153
    call = Call(CallStart.now("/v1/chat/completions"), clock)
    call.set_route(RouteChoice(model="pair", pool="pair"))
    call.set_job(GenerationJob("chatcmpl-1", "pair", "chat", SamplingParams(max_tokens=11),
                               prompt_token_ids=tuple(range(20))))
    if choice is not None:
        call.set_replica(choice)
    return Trace.of_call(call, outcome)


def test_per_call_series_carry_the_replica_the_trace_names():
    metrics = Metrics(lambda: GATEWAY_STATS)
    ok = CallOutcome(200, prompt_tokens=20, completion_tokens=11, max_choice_tokens=11, finish_reason="length")
    metrics.observe(finished_call(ReplicaChoice("pair", "w2", "least_loaded", num_failed_attempts=1), ok))
    metrics.observe(finished_call(ReplicaChoice("pair", "w2", "affinity"), ok))
    metrics.observe(finished_call(ReplicaChoice("pair", "", "none", num_failed_attempts=2),
                                  CallOutcome(503, error="no replica"), num_stages=5))  # every replica failed it
    metrics.observe(make_trace("r429", status=429, route=None, ttft_ms=None, tpot_ms=None))  # refused before routing
    _, s = scrape(metrics)

    routed = {labels: value for (name, labels), value in s.items() if name == "tokenway_routed_requests_total"}
    assert routed == {at("pair", "w2", reason="least_loaded", status="200"): 1,
                      at("pair", "w2", reason="affinity", status="200"): 1,
                      at("pair", "", reason="none", status="503"): 1,
                      at("", "", reason="", status="429"): 1}
    assert s[("tokenway_routed_time_to_first_token_seconds_count", at("pair", "w2"))] == 2
    assert s[("tokenway_routed_time_to_first_token_seconds_sum", at("pair", "w2"))] == pytest.approx(0.100)
    assert s[("tokenway_routed_time_per_output_token_seconds_sum", at("pair", "w2"))] == pytest.approx(0.020)
    assert s[("tokenway_routed_e2e_request_latency_seconds_count", at("pair", "w2"))] == 2
    assert s[("tokenway_routed_e2e_request_latency_seconds_count", at("pair", ""))] == 1
    assert s[("tokenway_routed_e2e_request_latency_seconds_count", at("", ""))] == 1
    for unrouted in (at("pair", ""), at("", "")):  # no first token
        assert ("tokenway_routed_time_to_first_token_seconds_count", unrouted) not in s
    # The per-model series keep their labels (dashboards and alerts query them as they were).
    assert s[("tokenway_time_to_first_token_seconds_count", (("model", "pair"),))] == 2
    assert s[("tokenway_requests_total", (("endpoint", "/v1/chat/completions"), ("finish_reason", "length"),
                                          ("model", "pair"), ("status", "200")))] == 2


def test_a_trace_from_an_old_ledger_row_without_a_route_counts_as_unrouted():
    metrics = Metrics()
    metrics.observe(Trace.from_dict({**make_trace().to_dict(), "route": None}))
    _, s = scrape(metrics)
    assert s[("tokenway_routed_requests_total", at("", "", reason="", status="200"))] == 1


def test_the_snapshot_carries_the_engine_and_the_replicas_apart():
    snapshot = Observer(lambda: ENGINE_SERVER_STATS).snapshot()
    assert snapshot["engine"] == {**ENGINE.to_dict(), "num_pending_http": 3}  # the payload without the replicas
    assert snapshot["replicas"] == REPLICAS
    json.dumps(snapshot)  # what the route sends


def test_a_gateways_snapshot_has_no_engine_and_its_samples_leave_engine_gaps():
    clock = [100.0]
    observer = Observer(lambda: GATEWAY_STATS, now=lambda: clock[0])
    observer.maybe_sample()
    observer.on_tokens("m", 30, 0.01)
    observer.record(make_trace(route={"pool": "remote", "replica": "oa", "reason": "only", "failed_attempts": 0}))
    clock[0] = 102.0
    snapshot = observer.snapshot()
    assert snapshot["engine"] is None
    assert snapshot["replicas"] == GATEWAY_STATS.replicas
    (point,) = snapshot["timeseries"]
    assert point["tokens_per_s"] == pytest.approx(15.0) and point["requests_per_s"] == pytest.approx(0.5)
    assert point["kv_usage"] is None and point["running"] is None and point["prefix_cache_hit_rate"] is None
    assert snapshot["traces"][0]["route"]["replica"] == "oa"
    json.dumps(snapshot)
