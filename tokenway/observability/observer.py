"""The Observer: where every finished call's Trace goes, and what the dashboard reads.

One per server, used from the event loop thread only. Off (`--no-observability`) means no
Observer at all: the request path checks `state.observer is None` and does nothing more.

`stats()` is the server's /engine/stats (ServedStats): the local engine's counts (None on a
pure gateway) and the replicas, pool -> replica -> health, load and tallies. The dashboard's
snapshot hands them on as "engine" (None without a local engine) and "replicas". The batch
runner, made after the observer (it runs lines through the app), is watched once it exists
(watch_batches): its tallies and the queue go to /metrics and to the snapshot's "batches".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from tokenway.engine.stats import EngineStats
from tokenway.observability.metrics import BatchCollector, Metrics, ServedStats
from tokenway.observability.traces import Trace, TraceRing, summarize
from tokenway.stages import STAGES

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0
NUM_SAMPLES = 300  # five minutes of one-second points


class Observer:
    def __init__(self, stats: Callable[[], ServedStats], trace_capacity: int = 2048, exporter=None,
                 now: Callable[[], float] = time.time, ledger_stats: Callable[[], dict] | None = None) -> None:
        self.stats = stats
        self.now = now
        self.traces = TraceRing(trace_capacity)
        self.metrics = Metrics(stats, ledger_stats)
        self.exporter = exporter  # an OtelExporter, or None
        self.num_generated_tokens = 0  # counted as tokens stream out, for throughput over time
        self.num_finished_requests = 0
        self.samples: deque[dict] = deque(maxlen=NUM_SAMPLES)
        self._last_sample: tuple[float, int, int] | None = None  # (time, tokens, requests)
        self.batch_stats: Callable[[], Mapping[str, Any]] | None = None

    def watch_batches(self, batch_stats: Callable[[], Mapping[str, Any]]) -> None:
        """The batch runner's RunnerStats.to_dict: in /metrics and the snapshot from now on. Once."""
        if self.batch_stats is not None:
            raise RuntimeError("the observer watches a batch runner already")
        self.batch_stats = batch_stats
        self.metrics.registry.register(BatchCollector(batch_stats))

    def record(self, trace: Trace) -> None:
        self.traces.add(trace)
        self.num_finished_requests += 1
        self.metrics.observe(trace)
        if self.exporter is not None:
            try:
                self.exporter.export(trace)
            except Exception:  # noqa: BLE001 - telemetry must never fail a request
                logger.exception("OTLP export of %s failed", trace.request_id)
        self.maybe_sample()

    def on_tokens(self, model: str, num_tokens: int, seconds_per_token: float | None) -> None:
        """A choice produced num_tokens more tokens, seconds_per_token after its previous ones."""
        self.num_generated_tokens += num_tokens
        if seconds_per_token is not None:
            self.metrics.itl.labels(model).observe(seconds_per_token)
        self.maybe_sample()

    def maybe_sample(self) -> None:
        """Add a point to the time series when a sample interval has passed. Called on activity
        and by dashboard reads, so an idle server takes no samples (and costs nothing)."""
        now = self.now()
        last = self._last_sample
        if last is not None and now - last[0] < SAMPLE_INTERVAL_S:
            return
        self._last_sample = (now, self.num_generated_tokens, self.num_finished_requests)
        if last is None:
            return
        elapsed = now - last[0]
        self.samples.append({
            "t": now,
            "tokens_per_s": (self.num_generated_tokens - last[1]) / elapsed,
            "requests_per_s": (self.num_finished_requests - last[2]) / elapsed,
            **engine_sample(self.stats().engine),
        })

    def snapshot(self, limit: int = 50, summary_over: int = 500) -> dict:
        """What /dashboard/api/snapshot returns."""
        self.maybe_sample()
        stats = self.stats()
        engine = None
        if stats.engine is not None:  # the payload's engine counts, num_pending_http with them
            engine = {key: value for key, value in stats.to_dict().items() if key != "replicas"}
        return {
            "stages": list(STAGES),
            "traces": [t.to_dict() for t in self.traces.recent(limit)],
            "summary": summarize(self.traces.recent(summary_over)),
            "timeseries": list(self.samples),
            "engine": engine,
            "replicas": stats.replicas,
            "batches": None if self.batch_stats is None else dict(self.batch_stats()),
        }

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()


def engine_sample(stats: EngineStats | None) -> dict:
    """A time-series point's engine part: None for each without a local engine (a gap in the charts)."""
    if stats is None:
        return dict.fromkeys(("kv_blocks_used", "kv_blocks_total", "kv_usage", "running", "waiting",
                              "prefix_cache_hit_rate"))
    total = stats.kv_blocks_total
    used = total - stats.kv_blocks_free
    return {"kv_blocks_used": used, "kv_blocks_total": total, "kv_usage": used / total if total else 0.0,
            "running": stats.num_running, "waiting": stats.num_waiting,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
