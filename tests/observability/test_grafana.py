"""The Grafana dashboard is a valid dashboard and queries only metrics (and labels) tokenway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tokenway

DASHBOARD = Path(tokenway.__file__).parent / "observability" / "grafana" / "tokenway.json"

# metric name -> its labels, as observability/metrics.py exports them.
HISTOGRAM_TO_LABELS = {
    "tokenway_time_to_first_token_seconds": {"model"},
    "tokenway_time_per_output_token_seconds": {"model"},
    "tokenway_inter_token_latency_seconds": {"model"},
    "tokenway_e2e_request_latency_seconds": {"model"},
    "tokenway_request_queue_time_seconds": {"model"},
    "tokenway_request_prefill_time_seconds": {"model"},
    "tokenway_request_decode_time_seconds": {"model"},
    "tokenway_stage_duration_seconds": {"stage"},
    "tokenway_routed_time_to_first_token_seconds": {"pool", "replica"},
    "tokenway_routed_time_per_output_token_seconds": {"pool", "replica"},
    "tokenway_routed_e2e_request_latency_seconds": {"pool", "replica"},
}
SERIES_TO_LABELS = {
    "tokenway_requests_total": {"model", "endpoint", "status", "finish_reason"},
    "tokenway_prompt_tokens_total": {"model"},
    "tokenway_cached_prompt_tokens_total": {"model"},
    "tokenway_completion_tokens_total": {"model"},
    "tokenway_cost_usd_total": {"model"},
    "tokenway_rate_limited_total": {"kind"},
    "tokenway_client_disconnects_total": {"model"},
    "tokenway_prefix_cache_lookups_total": {"outcome"},
    "tokenway_prefix_cache_queried_tokens_total": set(),
    "tokenway_prefix_cache_hit_tokens_total": set(),
    "tokenway_preemptions_total": set(),
    "tokenway_interjected_steps_total": set(),
    "tokenway_requests_running": set(),
    "tokenway_requests_waiting": set(),
    "tokenway_kv_cache_blocks_used": set(),
    "tokenway_kv_cache_blocks_total": set(),
    "tokenway_kv_cache_usage_ratio": set(),
    "tokenway_prefix_cache_hit_ratio": set(),
    "tokenway_spec_decode_num_drafts_total": set(),
    "tokenway_spec_decode_num_draft_tokens_total": set(),
    "tokenway_spec_decode_num_accepted_tokens_total": set(),
    "tokenway_spec_decode_acceptance_ratio": set(),
    "tokenway_routed_requests_total": {"pool", "replica", "reason", "status"},
    "tokenway_replica_up": {"pool", "replica", "kind"},
    "tokenway_replica_in_flight": {"pool", "replica"},
    "tokenway_replica_outstanding_tokens": {"pool", "replica"},
    "tokenway_replica_calls_total": {"pool", "replica"},
    "tokenway_replica_failures_total": {"pool", "replica"},
    "tokenway_replica_prompt_tokens_total": {"pool", "replica"},
    "tokenway_replica_cached_prompt_tokens_total": {"pool", "replica"},
    "tokenway_replica_completion_tokens_total": {"pool", "replica"},
    "tokenway_replica_prefix_cache_hit_ratio": {"pool", "replica"},
}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_METRIC = re.compile(r"\btokenway_[a-z0-9_]+")
_SELECTOR = re.compile(r"\b(tokenway_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"[^"]*"\s*')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def series_labels(name: str) -> set[str]:
    """The labels of a series name as PromQL sees it; KeyError for a name tokenway doesn't export."""
    if name in SERIES_TO_LABELS:
        return SERIES_TO_LABELS[name]
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAM_TO_LABELS:
            labels = HISTOGRAM_TO_LABELS[name.removesuffix(suffix)]
            return labels | {"le"} if suffix == "_bucket" else labels
    raise KeyError(name)


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_exprs(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [variable["query"]["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    return exprs


def test_series_labels_rejects_what_is_not_exported():
    assert series_labels("tokenway_stage_duration_seconds_bucket") == {"stage", "le"}
    for name in ("tokenway_stage_duration_seconds", "tokenway_requests_total_sum", "tokenway_ttft_seconds_bucket"):
        with pytest.raises(KeyError):
            series_labels(name)


def test_the_label_maps_are_what_tokenway_exports():
    """The maps above are what Metrics exports: every series (engine and replicas included), no more."""
    from tokenway.observability.metrics import Metrics

    from .test_replicas import ENGINE_SERVER_STATS, scrape
    from .test_traces import make_trace

    metrics = Metrics(lambda: ENGINE_SERVER_STATS)
    route = {"pool": "pair", "replica": "w1", "reason": "affinity", "failed_attempts": 0}
    for trace in (make_trace(route=route), make_trace("r429", status=429, limit_kind="tokens"),
                  make_trace("r499", status=499)):
        metrics.observe(trace)
    metrics.itl.labels("m").observe(0.01)
    _, samples = scrape(metrics)
    exported: dict[str, set[str]] = {}
    for name, labels in samples:
        if name.startswith("tokenway_") and not name.endswith("_created"):
            exported.setdefault(name, set()).update(label for label, _ in labels)
    expected = dict(SERIES_TO_LABELS)
    for name, labels in HISTOGRAM_TO_LABELS.items():
        expected |= {f"{name}_bucket": labels | {"le"}, f"{name}_sum": labels, f"{name}_count": labels}
    assert exported == expected  # (the ledger's counters, not on the dashboard, need ledger_stats)


def test_dashboard_shape():
    dashboard = load()
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model"]["query"]["query"] == "label_values(tokenway_requests_total, model)"
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]

    panels = dashboard["panels"]
    assert len(panels) >= 12
    assert len({panel["id"] for panel in panels}) == len(panels)
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in ("timeseries", "bargauge", "stat", "gauge")
        assert panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells


def test_every_metric_in_every_expr_is_exported():
    for expr in all_exprs(load()):
        names = _METRIC.findall(expr)
        assert names, expr
        for name in names:
            try:
                series_labels(name)
            except KeyError:
                pytest.fail(f"{name!r} in {expr!r} is not a tokenway metric series")


def test_every_label_in_every_expr_belongs_to_its_metric():
    for expr in all_exprs(load()):
        for name, matchers in _SELECTOR.findall(expr):
            labels = {m.group(1) for m in _MATCHER.finditer(matchers)}
            assert labels <= series_labels(name), f"{name} has no label {labels - series_labels(name)}: {expr!r}"
        # Grouping labels must exist on every series of the expression (`le` only on buckets).
        grouped = {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",") if label.strip()}
        for name in _METRIC.findall(expr):
            assert grouped <= series_labels(name), f"{name} has no label {grouped - series_labels(name)}: {expr!r}"


def test_the_model_filter_reaches_every_model_labelled_series():
    # A per-model panel whose query ignores $model would silently show all models.
    for expr in all_exprs(load()):
        for name in _METRIC.findall(expr):
            if "model" in series_labels(name) and not expr.startswith("label_values"):
                assert re.search(rf'{name}\{{[^}}]*model=~"\$model"', expr), expr
