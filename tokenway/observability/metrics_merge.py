"""One /metrics for a host's N workers (`tokenway serve --workers N`): their expositions merged.

The workers' metrics cannot share prometheus-client's multiprocess files: most of them are
collectors read from each process's own stats at scrape time (metrics.py). So the worker a
scrape reaches reads the others' own expositions (server/workers.py) and merges them here:

    counters, histograms, summaries   summed per series (a histogram's buckets are the same in
                                      every worker, so summing each bucket sums the histograms);
                                      *_created: the earliest
    gauges and untyped                kept per worker, with a `worker` label: a sum is right for
                                      some (requests in flight) and wrong for others (the batch
                                      queue, which every worker reads from one database), so the
                                      query chooses (sum by, max by)

A worker replaced (a SIGHUP reload, a crash) takes its counts with it: the host's counters then
fall, which Prometheus reads as a reset, as it does a restarted server's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
WORKER_LABEL = "worker"


class _Families:
    """A collector that yields metric families already made."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_expositions(worker_to_text: list[tuple[str, bytes]]) -> bytes:
    """(worker label, its own exposition) of each worker ─► one exposition of the host."""
    name_to_family: dict[str, Metric] = {}
    name_to_series: dict[str, dict[tuple, Sample]] = {}
    for worker, text in worker_to_text:
        for family in text_string_to_metric_families(text.decode()):
            merged = name_to_family.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit))
            series = name_to_series.setdefault(family.name, {})
            summed = family.type in SUMMED_TYPES
            for sample in family.samples:
                labels = sample.labels if summed else {**sample.labels, WORKER_LABEL: worker}
                key = (sample.name, tuple(sorted(labels.items())))
                prior = series.get(key)
                value = sample.value
                if prior is not None and summed:
                    value = min(prior.value, value) if sample.name.endswith("_created") else prior.value + value
                series[key] = Sample(sample.name, labels, value)
            merged.samples = list(series.values())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(name_to_family.values()))  # pyright: ignore[reportArgumentType]
    return generate_latest(registry)
