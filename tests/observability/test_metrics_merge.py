"""observability/metrics_merge.py: N workers' expositions as one host's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenway.observability.metrics import Metrics
from tokenway.observability.metrics_merge import merge_expositions


def series(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_counters_and_histograms_sum_and_gauges_stay_per_worker():
    first, second = Metrics(), Metrics()
    first.requests.labels("m", "chat", "200", "stop").inc(3)
    second.requests.labels("m", "chat", "200", "stop").inc(4)
    second.requests.labels("m", "chat", "429", "none").inc()
    first.e2e.labels("m").observe(0.003)
    second.e2e.labels("m").observe(0.3)
    merged = series(merge_expositions([("0", first.exposition()), ("1", second.exposition())]))
    labels = (("endpoint", "chat"), ("finish_reason", "stop"), ("model", "m"), ("status", "200"))
    assert merged[("tokenway_requests_total", labels)] == 7
    assert merged[("tokenway_requests_total", (("endpoint", "chat"), ("finish_reason", "none"), ("model", "m"),
                                               ("status", "429")))] == 1
    bucket = "tokenway_e2e_request_latency_seconds_bucket"
    assert merged[(bucket, (("le", "0.005"), ("model", "m")))] == 1
    assert merged[(bucket, (("le", "0.5"), ("model", "m")))] == 2
    assert merged[("tokenway_e2e_request_latency_seconds_count", (("model", "m"),))] == 2
    assert abs(merged[("tokenway_e2e_request_latency_seconds_sum", (("model", "m"),))] - 0.303) < 1e-9
    starts = {labels for (name, labels) in merged if name == "process_start_time_seconds"}
    assert starts == {(("worker", "0"),), (("worker", "1"),)}


def test_one_worker_is_its_own_exposition_with_a_worker_label_on_gauges():
    metrics = Metrics()
    metrics.requests.labels("m", "chat", "200", "stop").inc(2)
    merged = series(merge_expositions([("3", metrics.exposition())]))
    own = series(metrics.exposition())
    assert {k: v for k, v in merged.items() if k[0] == "tokenway_requests_total"} == \
        {k: v for k, v in own.items() if k[0] == "tokenway_requests_total"}
