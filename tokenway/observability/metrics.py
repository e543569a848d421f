"""Prometheus metrics: names under tokenway_, units in the names, _total on counters.

Request metrics are observed once per call from its Trace (and inter-token latency once per
engine output); engine gauges and the replicas' health and load are read from the server's
stats (ServedStats: /engine/stats) when Prometheus scrapes, so neither the engine thread nor the
router touches a metric. Each server has its own CollectorRegistry.

    Trace ──► Metrics.observe     tokenway_requests_total{model,...}, latency histograms by model,
                                  tokenway_routed_*{pool,replica}: the same calls by the replica
                                  that ran them ("" for calls that never reached one)
    stats ──► EngineCollector     .engine: tokenway_requests_running, tokenway_kv_cache_*, ... (a
                                  server with a local engine only: a pure gateway's engine is None);
                                  tokenway_class_*{class}: the same per service class
          └─► ReplicaCollector    .replicas: tokenway_replica_*{pool,replica}: health, load, calls, tokens
    batch runner ──► BatchCollector   tokenway_batch_*: this server's lines by outcome; the queue's
                                      batches by status and lines waiting (the database's: every
                                      gateway on it reports the same, so take max, not sum)
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from tokenway.engine.stats import ClassStats, EngineStats
from tokenway.observability.metrics_merge import merge_expositions
from tokenway.observability.traces import Trace
from tokenway.stages import STAGES

# pool -> replica -> its health, load and tallies (Router.stats)
PoolReplicas = Mapping[str, Mapping[str, Mapping[str, Any]]]

# Buckets in seconds. Latency: 1 ms .. 2 min; per token: 1 ms .. 2.5 s; stages: 10 µs .. 2 min.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)
STAGE_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class ServedStats(Protocol):
    """What observability reads of the server's stats (server/stats.py's ServerStats)."""

    @property
    def engine(self) -> EngineStats | None:
        """The local engine's counts; None on a pure gateway."""
        ...

    @property
    def replicas(self) -> PoolReplicas: ...

    def to_dict(self) -> dict[str, Any]:
        """The /engine/stats payload."""
        ...


class Family:
    """A labelled histogram or counter of the calls' figures, kept as plain numbers: one
    child per label values, looked up in a dict, and an observation is a bisect and two
    additions. prometheus_client's own metrics take a lock per addition and walk the buckets;
    a call observes some twenty children, and that was a tenth of a gateway call's time
    (bench/gateway_peers.sh). Observed from the event loop thread only (the Observer's); read
    by `collect` at scrape time, which may see one call's figures half added."""

    __slots__ = ("name", "doc", "labelnames", "buckets", "_children")

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], buckets: tuple[float, ...] | None = None
                 ) -> None:
        if buckets is not None and list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must increase")
        self.name, self.doc, self.labelnames, self.buckets = name, doc, labelnames, buckets
        self._children: dict[tuple[str, ...], Any] = {}  # a HistogramChild each, or a CounterChild each

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}")
            values = tuple(map(str, values))
            child = self._children[values] = (CounterChild() if self.buckets is None
                                              else HistogramChild(self.buckets))
        return child

    def collect(self) -> Any:
        """The family as prometheus_client exposes a Counter's or Histogram's, _created included."""
        created = []
        if self.buckets is None:
            family: Any = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, child in list(self._children.items()):
                family.add_metric(values, child.value, created=child.created)
            return family
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        bounds = [*map(floatToGoString, self.buckets), "+Inf"]
        for values, child in list(self._children.items()):
            running, cumulative = 0, []
            for bound, count in zip(bounds, child.counts):
                running += count
                cumulative.append((bound, float(running)))
            family.add_metric(values, cumulative, child.sum)
            created.append(Sample(self.name + "_created", dict(zip(self.labelnames, values)), child.created))
        family.samples.extend(created)
        return family


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf's
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bucket whose bound is >= amount
        self.sum += amount


class CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class CallFamilies(Collector):
    """The Families of Metrics, exposed from the server's registry."""

    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self) -> Iterator:
        for family in self.families:
            yield family.collect()

    def describe(self) -> Iterator:
        for family in self.families:
            yield (CounterMetricFamily if family.buckets is None else HistogramMetricFamily)(family.name, family.doc,
                                                                                            labels=family.labelnames)


class Metrics:
    def __init__(self, stats: Callable[[], ServedStats] | None = None,
                 ledger_stats: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # --workers N (server/workers.py): the other workers' own expositions, by worker label.
        self.peers: Callable[[], Awaitable[list[tuple[str, bytes]]]] | None = None
        self.worker_label = ""

        families: list[Family] = []

        def histogram(name: str, doc: str, buckets: tuple, labels: tuple = ("model",)) -> Family:
            families.append(Family(name, doc, labels, buckets))
            return families[-1]

        def counter(name: str, doc: str, labels: tuple = ("model",)) -> Family:
            families.append(Family(name, doc, labels))
            return families[-1]

        self.ttft = histogram("tokenway_time_to_first_token_seconds", "From request received to first token.",
                              LATENCY_BUCKETS)
        self.tpot = histogram("tokenway_time_per_output_token_seconds",
                              "Decode time per output token after the first, per request.", TOKEN_BUCKETS)
        self.itl = histogram("tokenway_inter_token_latency_seconds",
                             "Time between consecutive tokens of one choice.", TOKEN_BUCKETS)
        self.e2e = histogram("tokenway_e2e_request_latency_seconds",
                             "From request received to the last byte sent.", LATENCY_BUCKETS)
        self.queue = histogram("tokenway_request_queue_time_seconds",
                               "From admission to first scheduled by the engine.", LATENCY_BUCKETS)
        self.prefill = histogram("tokenway_request_prefill_time_seconds",
                                 "From first scheduled to the first token.", LATENCY_BUCKETS)
        self.decode = histogram("tokenway_request_decode_time_seconds",
                                "From the first token to the last.", LATENCY_BUCKETS)
        self.stage = histogram("tokenway_stage_duration_seconds",
                               "Time spent in each stage of the request path.", STAGE_BUCKETS, ("stage",))
        self.requests = counter("tokenway_requests", "Generation calls by outcome.",
                                ("model", "endpoint", "status", "finish_reason"))
        self.prompt_tokens = counter("tokenway_prompt_tokens", "Prompt tokens (including cached ones).")
        self.cached_tokens = counter("tokenway_cached_prompt_tokens", "Prompt tokens served from the prefix cache.")
        self.completion_tokens = counter("tokenway_completion_tokens", "Generated tokens.")
        self.reasoning_tokens = counter("tokenway_reasoning_tokens", "Generated tokens spent thinking.")
        self.cost = counter("tokenway_cost_usd", "Billed cost in US dollars.")
        self.rate_limited = counter("tokenway_rate_limited", "Calls refused with 429, by the limit that refused.",
                                    ("kind",))
        self.disconnects = counter("tokenway_client_disconnects", "Calls whose client left before the end.")
        self.cache_lookups = counter("tokenway_prefix_cache_lookups", "Prefix-cache outcomes of admitted prompts.",
                                     ("outcome",))
        # The same calls by where they ran: the replica of trace.route (the last one tried).
        self.routed_requests = counter("tokenway_routed_requests",
                                       "Generation calls by the replica that ran them, why it was picked, and "
                                       "outcome; pool and replica are \"\" for calls that never reached one.",
                                       ("pool", "replica", "reason", "status"))
        self.routed_ttft = histogram("tokenway_routed_time_to_first_token_seconds",
                                     "From request received to first token, by replica.", LATENCY_BUCKETS,
                                     ("pool", "replica"))
        self.routed_tpot = histogram("tokenway_routed_time_per_output_token_seconds",
                                     "Decode time per output token after the first, per request, by replica.",
                                     TOKEN_BUCKETS, ("pool", "replica"))
        self.routed_e2e = histogram("tokenway_routed_e2e_request_latency_seconds",
                                    "From request received to the last byte sent, by replica.", LATENCY_BUCKETS,
                                    ("pool", "replica"))
        r.register(CallFamilies(families))
        if stats is not None:
            r.register(EngineCollector(lambda: stats().engine))
            r.register(ReplicaCollector(lambda: stats().replicas))
        if ledger_stats is not None:
            r.register(LedgerCollector(ledger_stats))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        PlatformCollector(registry=r)

    def observe(self, trace: Trace) -> None:
        """Everything about one finished call, once."""
        model = trace.model or "unknown"
        stages = trace.stages_ms
        self.requests.labels(model, trace.endpoint, str(trace.status), trace.finish_reason or "none").inc()
        self.e2e.labels(model).observe(trace.total_ms / 1000)
        for stage in STAGES:
            self.stage.labels(stage).observe(stages.get(stage, 0.0) / 1000)
        if trace.status == 429:
            self.rate_limited.labels(trace.limit_kind or "unknown").inc()
        if trace.status == 499:
            self.disconnects.labels(model).inc()
        if trace.prompt_tokens:
            self.prompt_tokens.labels(model).inc(trace.prompt_tokens)
            self.cached_tokens.labels(model).inc(trace.cached_tokens)
        if trace.completion_tokens:
            self.completion_tokens.labels(model).inc(trace.completion_tokens)
        if trace.reasoning_tokens:
            self.reasoning_tokens.labels(model).inc(trace.reasoning_tokens)
        if trace.cost_usd:
            self.cost.labels(model).inc(trace.cost_usd)
        if trace.cache_reason is not None:
            self.cache_lookups.labels(trace.cache_reason).inc()
        if trace.ttft_ms is not None:
            self.ttft.labels(model).observe(trace.ttft_ms / 1000)
            self.queue.labels(model).observe(stages.get("queue", 0.0) / 1000)
            self.prefill.labels(model).observe(stages.get("prefill", 0.0) / 1000)
            self.decode.labels(model).observe(stages.get("decode", 0.0) / 1000)
        if trace.tpot_ms is not None:
            self.tpot.labels(model).observe(trace.tpot_ms / 1000)
        self.observe_route(trace)

    def observe_route(self, trace: Trace) -> None:
        route = trace.route or {}  # None: refused (or failed) before the router picked a replica
        pool, replica = route.get("pool", ""), route.get("replica", "")
        self.routed_requests.labels(pool, replica, route.get("reason", ""), str(trace.status)).inc()
        self.routed_e2e.labels(pool, replica).observe(trace.total_ms / 1000)
        if trace.ttft_ms is not None:
            self.routed_ttft.labels(pool, replica).observe(trace.ttft_ms / 1000)
        if trace.tpot_ms is not None:
            self.routed_tpot.labels(pool, replica).observe(trace.tpot_ms / 1000)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def host_exposition(self, own_only: bool = False) -> bytes:
        """With --workers N, every worker's metrics merged (metrics_merge.py); else this process's."""
        own = self.exposition()
        if own_only or self.peers is None:
            return own
        return merge_expositions([(self.worker_label, own), *await self.peers()])


class EngineCollector(Collector):
    """Engine gauges, read at scrape time from `engine_stats()`; none at all for a server
    without a local engine (None)."""

    def __init__(self, engine_stats: Callable[[], EngineStats | None]) -> None:
        self.engine_stats = engine_stats

    def collect(self) -> Iterator:
        stats = self.engine_stats()
        if stats is None:
            return
        used = stats.kv_blocks_total - stats.kv_blocks_free
        yield GaugeMetricFamily("tokenway_requests_running", "Requests in the running batch.",
                                value=stats.num_running)
        yield GaugeMetricFamily("tokenway_requests_waiting", "Requests waiting for the engine.",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("tokenway_kv_cache_blocks_used", "KV blocks held by requests.", value=used)
        yield GaugeMetricFamily("tokenway_kv_cache_blocks_total", "KV blocks in the pool.",
                                value=stats.kv_blocks_total)
        yield GaugeMetricFamily("tokenway_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.",
                                value=used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        yield GaugeMetricFamily("tokenway_prefix_cache_hit_ratio",
                                "Prompt tokens hit / looked up in the prefix cache since start.",
                                value=stats.prefix_cache_hit_rate)
        yield CounterMetricFamily("tokenway_prefix_cache_queried_tokens", "Prompt tokens looked up in the cache.",
                                  value=stats.prefix_cache_queried_tokens)
        yield CounterMetricFamily("tokenway_prefix_cache_hit_tokens", "Prompt tokens found in the cache.",
                                  value=stats.prefix_cache_hit_tokens)
        yield CounterMetricFamily("tokenway_preemptions", "Requests preempted to free KV blocks.",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("tokenway_interjected_steps",
                                  "Steps of newly arrived requests run between two layers of a batch step.",
                                  value=stats.num_interjected_steps)
        # vLLM's names; 0 for an engine that does not speculate.
        yield CounterMetricFamily("tokenway_spec_decode_num_drafts",
                                  "Verify steps of a request with drafted tokens (speculative decoding).",
                                  value=stats.spec_decode_num_drafts)
        yield CounterMetricFamily("tokenway_spec_decode_num_draft_tokens", "Tokens drafted for verification.",
                                  value=stats.spec_decode_num_draft_tokens)
        yield CounterMetricFamily("tokenway_spec_decode_num_accepted_tokens",
                                  "Drafted tokens the verification accepted.",
                                  value=stats.spec_decode_num_accepted_tokens)
        yield GaugeMetricFamily("tokenway_spec_decode_acceptance_ratio",
                                "Accepted / drafted tokens since start (0 before any draft).",
                                value=stats.spec_decode_acceptance_rate)
        if stats.classes is not None:
            yield from class_families(stats.classes)

    def describe(self) -> Iterator:
        return iter(())


# ClassStats field -> (family, name, help) of each service class's series, labelled {class}.
CLASS_SERIES = {
    "num_running": (GaugeMetricFamily, "tokenway_class_requests_running",
                    "Requests of the class in the running batch."),
    "num_waiting": (GaugeMetricFamily, "tokenway_class_requests_waiting",
                    "Requests of the class waiting for the engine."),
    "num_preemptions": (CounterMetricFamily, "tokenway_class_preemptions",
                        "Requests of the class preempted, to free KV blocks or for a better class."),
    "num_prompt_tokens": (CounterMetricFamily, "tokenway_class_prompt_tokens",
                          "Prompt tokens of the class's requests the engine admitted."),
    "num_generated_tokens": (CounterMetricFamily, "tokenway_class_generated_tokens",
                             "Tokens the engine generated for the class's requests."),
}


def class_families(classes: tuple[ClassStats, ...]) -> Iterator:
    """The engine's counts per service class, one series per class (a bounded label set)."""
    for key, (family, name, doc) in CLASS_SERIES.items():
        metric = family(name, doc, labels=("class",))
        for entry in classes:
            metric.add_metric((entry.service_class,), getattr(entry, key))
        yield metric


# stats key -> (family, name, help) of each replica's series, labelled {pool, replica}.
REPLICA_SERIES = {
    "num_in_flight": (GaugeMetricFamily, "tokenway_replica_in_flight", "Calls running on the replica now."),
    "num_outstanding_tokens": (GaugeMetricFamily, "tokenway_replica_outstanding_tokens",
                               "Tokens (prompt + max_tokens) reserved by the calls running on the replica."),
    "num_calls": (CounterMetricFamily, "tokenway_replica_calls",
                  "Calls sent to the replica, the ones it failed and the ones failed over included."),
    "num_failures": (CounterMetricFamily, "tokenway_replica_failures",
                     "Calls the replica failed (its fault, as its circuit breaker counts them)."),
    "prompt_tokens": (CounterMetricFamily, "tokenway_replica_prompt_tokens",
                      "Prompt tokens (including cached ones) of the usage the replica reported."),
    "cached_tokens": (CounterMetricFamily, "tokenway_replica_cached_prompt_tokens",
                      "Prompt tokens the replica served from its prefix cache, as it reported them."),
    "completion_tokens": (CounterMetricFamily, "tokenway_replica_completion_tokens",
                          "Tokens the replica generated, as it reported them."),
}


class ReplicaCollector(Collector):
    """Every pool's replicas, read at scrape time from `replica_stats()`: pool -> replica ->
    its health, load and tallies since start (Router.stats, the "replicas" of /engine/stats).
    Label sets are bounded by the configured replicas."""

    def __init__(self, replica_stats: Callable[[], PoolReplicas]) -> None:
        self.replica_stats = replica_stats

    def collect(self) -> Iterator:
        labels = ("pool", "replica")
        up = GaugeMetricFamily("tokenway_replica_up", "1 while the balancer may pick the replica, 0 while it is "
                               "unavailable (breaker open, probe failed).", labels=(*labels, "kind"))
        key_to_family = {key: family(name, doc, labels=labels) for key, (family, name, doc) in REPLICA_SERIES.items()}
        hit_ratio = GaugeMetricFamily("tokenway_replica_prefix_cache_hit_ratio",
                                      "Cached / prompt tokens of the usage the replica reported since start "
                                      "(absent until it reported any).", labels=labels)
        for pool, name_to_replica in self.replica_stats().items():
            for name, replica in name_to_replica.items():
                up.add_metric((pool, name, replica["kind"]), 1.0 if replica["available"] else 0.0)
                for key, family in key_to_family.items():
                    family.add_metric((pool, name), replica[key])
                if replica["prefix_cache_hit_rate"] is not None:
                    hit_ratio.add_metric((pool, name), replica["prefix_cache_hit_rate"])
        yield up
        yield from key_to_family.values()
        yield hit_ratio

    def describe(self) -> Iterator:
        return iter(())


class BatchCollector(Collector):
    """The batch runner's RunnerStats.to_dict(), read at scrape time: its own lines, and the queue
    as its last upkeep (every few seconds) read it. Labels are bounded: outcomes and statuses."""

    def __init__(self, batch_stats: Callable[[], Mapping[str, Any]]) -> None:
        self.batch_stats = batch_stats

    def collect(self) -> Iterator:
        stats = self.batch_stats()
        lines = CounterMetricFamily("tokenway_batch_lines", "Batch lines this server ran to an end, by outcome "
                                    "(failed: the API answered an error).", labels=("outcome",))
        for outcome, num in stats["num_lines_by_outcome"].items():
            lines.add_metric((outcome,), num)
        yield lines
        yield CounterMetricFamily("tokenway_batch_line_deferrals", "Batch lines this server put back after a 429 "
                                  "or 503, to run again after the wait it asked.", value=stats["num_deferred"])
        yield GaugeMetricFamily("tokenway_batch_lines_running", "Batch lines running on this server now.",
                                value=stats["num_running"])
        queue = stats["queue"]
        if queue is None:  # not read yet
            return
        batches = GaugeMetricFamily("tokenway_batches", "Batches kept in the database, by status (every "
                                    "gateway's).", labels=("status",))
        for status, num in queue["num_batches_by_status"].items():
            batches.add_metric((status,), num)
        yield batches
        yield GaugeMetricFamily("tokenway_batch_lines_pending", "Batch lines waiting for a runner (the queue's "
                                "depth, every gateway's).", value=queue["num_lines_pending"])
        yield GaugeMetricFamily("tokenway_batch_lines_claimed", "Batch lines a runner holds: running, or deferred "
                                "until their wait is over (every gateway's).", value=queue["num_lines_claimed"])

    def describe(self) -> Iterator:
        return iter(())


class LedgerCollector(Collector):
    """The usage ledger's writer, read at scrape time from `ledger_stats()` (Ledger.stats)."""

    def __init__(self, ledger_stats: Callable[[], dict]) -> None:
        self.ledger_stats = ledger_stats

    def collect(self) -> Iterator:
        stats = self.ledger_stats()
        yield CounterMetricFamily("tokenway_ledger_rows_written", "Ledger rows committed to the database.",
                                  value=stats["num_rows_written"])
        yield CounterMetricFamily("tokenway_ledger_quarantined_rows",
                                  "Ledger rows the database refused or the journal could not read back, kept in "
                                  "the dead-letter file instead.", value=stats["num_rows_quarantined"])
        if "degraded" not in stats:  # a source that reports the counters only
            return
        yield GaugeMetricFamily("tokenway_ledger_degraded",
                                "1 while the ledger's database is not taking rows (they wait in the journal and "
                                "are committed once it is back).", value=int(stats["degraded"]))
        yield GaugeMetricFamily("tokenway_ledger_pending_rows",
                                "Ledger rows recorded by this process and not yet committed.",
                                value=stats["num_pending_rows"])
        yield CounterMetricFamily("tokenway_ledger_dropped_rows",
                                  "Ledger rows lost: recorded without a journal while the database was down, past "
                                  "max_pending_rows.", value=stats["num_rows_dropped"])

    def describe(self) -> Iterator:
        return iter(())
