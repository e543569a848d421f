"""One Trace per generation call: the stage waterfall plus what the call produced and cost.

    GatewayMiddleware (after the last byte, or the client gone) ── Trace ──► Observer
        ├─► TraceRing       bounded, newest first: GET /v1/traces/{id}, the dashboard
        ├─► Metrics         Prometheus histograms and counters
        └─► OTel exporter   spans per stage, only when an endpoint is configured
    The ledger row carries the same stages (as of its commit) for `tokenway trace` later.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from tokenway.protocol.job import GenerationJob
from tokenway.stages import STAGES

# Why the prefix cache stopped where it did (kv_cache/manager.py sets the first four).
CACHE_EXPLANATIONS = {
    "hit": "every full block before the last prompt token was cached",
    "no_full_block": "the prompt is shorter than one KV block (+1 token), so nothing could be shared",
    "not_cached": "the first block not served from cache was never cached: no earlier prompt shared it",
    "evicted": "the first block not served from cache had been cached, but was evicted to make room",
    "disabled": "prefix caching is off on this server",
}


def explain_cache(reason: str | None, num_cached_tokens: int, num_prompt_tokens: int) -> str | None:
    if reason is None:
        return None
    why = CACHE_EXPLANATIONS.get(reason, reason)
    return f"{num_cached_tokens} of {num_prompt_tokens} prompt tokens cached; {why}"


@dataclass(slots=True)
class Trace:
    request_id: str
    endpoint: str
    model: str
    key_id: str
    status: int
    started_at: float  # unix seconds
    stages_ms: dict[str, float]  # every stage of STAGES, in order, adding up to total_ms
    total_ms: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # decode time per output token after the first
    stream: bool = False
    num_choices: int = 1
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those a reasoning model spent thinking
    finish_reason: str | None = None
    error: str | None = None
    cost_usd: float = 0.0
    cache_reason: str | None = None
    limit_kind: str | None = None  # which limit refused it (a 429)
    sampling: dict = field(default_factory=dict)  # temperature, top_p, max_tokens, seed, n as requested
    traceparent: str | None = None  # the caller's W3C trace context, when it sent one
    route: dict | None = None  # the routing stage's choice: pool, replica, and why that replica
    json_complete: bool | None = None  # a JSON reply: whole (True) or cut short (False); None: none asked
    # The safety stage: per direction, the categories found and the action taken, and its time
    # (input: its stage; output: the checks summed over the reply). None: no policy is on.
    safety: dict | None = None
    # The Batch API line the call ran (CallStart.batch_line: its batch id's random part, "l", its
    # index); None for a call made over HTTP.
    batch_line: str | None = None
    response_cache: str | None = None  # "hit" (answered from the response cache) or "miss"; None: not covered
    # The types of the tools the caller listed that the model was not shown (GenerationJob's omitted_tools).
    omitted_tools: list[str] = field(default_factory=list)

    @classmethod
    def of_call(cls, call, outcome, cost_usd: float = 0.0) -> Trace:
        """The trace of one call (gateway/call.py's Call and its CallOutcome), as of now."""
        clock, job, replica = call.clock, call.job, call.replica
        stages_ms = clock.durations_ms()
        sampling = job.sampling() if job is not None else {}
        return cls(
            request_id=call.request_id, endpoint=call.start.endpoint, model=call.model,
            key_id=call.start.principal.key_id, status=outcome.status, started_at=call.start.started_at,
            stages_ms=stages_ms, total_ms=clock.total_ms, ttft_ms=clock.ttft_ms,
            tpot_ms=tpot_ms(stages_ms["decode"], outcome.max_choice_tokens) if clock.ended("decode") else None,
            stream=job is not None and job.stream, num_choices=job.n if job is not None else 1,
            prompt_tokens=outcome.prompt_tokens, cached_tokens=outcome.cached_tokens,
            completion_tokens=outcome.completion_tokens, reasoning_tokens=outcome.reasoning_tokens,
            finish_reason=outcome.finish_reason, error=outcome.error, cost_usd=cost_usd,
            cache_reason=outcome.cache_reason, limit_kind=outcome.limit_kind, sampling=sampling,
            traceparent=call.start.traceparent,
            route=None if replica is None else {"pool": replica.pool, "replica": replica.replica,
                                                "reason": replica.reason,
                                                "failed_attempts": replica.num_failed_attempts},
            json_complete=outcome.json_complete, safety=safety_of(call, outcome), batch_line=call.start.batch_line,
            response_cache=outcome.response_cache,
            omitted_tools=list(job.omitted_tools) if isinstance(job, GenerationJob) else [],
        )

    # What the ledger row keeps besides its own columns (`tokenway trace` rebuilds the rest).
    LEDGER_FIELDS = ("endpoint", "total_ms", "ttft_ms", "tpot_ms", "stream", "num_choices", "cache_reason",
                     "limit_kind", "sampling", "route", "json_complete", "safety", "batch_line", "response_cache",
                     "omitted_tools")

    def ledger_fields(self) -> dict:
        return {name: getattr(self, name) for name in self.LEDGER_FIELDS}

    @classmethod
    def from_usage_record(cls, row) -> Trace:
        """A trace rebuilt from a ledger row (billing/ledger.py UsageRecord)."""
        extras = {k: v for k, v in row.trace.items() if k in cls.LEDGER_FIELDS}
        extras.setdefault("endpoint", "")
        extras.setdefault("total_ms", sum(row.stages_ms.values()))
        return cls(request_id=row.request_id, model=row.model, key_id=row.key_id, status=row.status,
                   started_at=row.started_at, stages_ms=row.stages_ms, prompt_tokens=row.prompt_tokens,
                   cached_tokens=row.cached_tokens, completion_tokens=row.completion_tokens,
                   reasoning_tokens=row.reasoning_tokens, finish_reason=row.finish_reason, error=row.error,
                   cost_usd=row.cost_usd, **extras)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["cache_explanation"] = explain_cache(self.cache_reason, self.cached_tokens, self.prompt_tokens)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Trace:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def tpot_ms(decode_ms: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first (the decode stage spans tokens 2..n)."""
    return decode_ms / (num_output_tokens - 1) if num_output_tokens > 1 else None


class TraceRing:
    """The last `capacity` traces, by request id. Used from the event loop thread only."""

    def __init__(self, capacity: int = 2048) -> None:
        if capacity < 1:
            raise ValueError(f"trace capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._request_id_to_trace: OrderedDict[str, Trace] = OrderedDict()

    def __len__(self) -> int:
        return len(self._request_id_to_trace)

    def add(self, trace: Trace) -> None:
        self._request_id_to_trace[trace.request_id] = trace
        self._request_id_to_trace.move_to_end(trace.request_id)
        while len(self._request_id_to_trace) > self.capacity:
            self._request_id_to_trace.popitem(last=False)

    def get(self, request_id: str) -> Trace | None:
        return self._request_id_to_trace.get(request_id)

    def recent(self, limit: int) -> list[Trace]:
        """Newest first."""
        traces = []
        for trace in reversed(self._request_id_to_trace.values()):
            if len(traces) >= limit:
                break
            traces.append(trace)
        return traces


def summarize(traces: list[Trace]) -> dict:
    """The live 'where the time went' table over completed calls (status 200): per stage
    the mean, p50 and p99 in ms and its share of the summed end-to-end time."""
    completed = [t for t in traces if t.status == 200]
    total = sum(t.total_ms for t in completed)
    stages = {}
    for stage in STAGES:
        values = [t.stages_ms.get(stage, 0.0) for t in completed]
        stages[stage] = {
            "mean_ms": statistics.fmean(values) if values else 0.0,
            "p50_ms": _quantile(values, 0.5),
            "p99_ms": _quantile(values, 0.99),
            "share": sum(values) / total if total > 0 else 0.0,
        }
    totals = [t.total_ms for t in completed]
    ttfts = [t.ttft_ms for t in completed if t.ttft_ms is not None]
    tpots = [t.tpot_ms for t in completed if t.tpot_ms is not None]
    return {
        "num_requests": len(traces),
        "num_completed": len(completed),
        "stages": stages,
        "total": {"mean_ms": statistics.fmean(totals) if totals else 0.0, "p50_ms": _quantile(totals, 0.5),
                  "p99_ms": _quantile(totals, 0.99)},
        "ttft_p50_ms": _quantile(ttfts, 0.5),
        "tpot_p50_ms": _quantile(tpots, 0.5),
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- text renderings (`tokenway trace`) ---------------------------------------------------

_BAR_WIDTH = 30


def render_waterfall(trace: dict) -> str:
    """A trace (as to_dict gives it) as a table: stage, ms, share of total, a bar placed where
    the stage fell on the request's timeline."""
    total = trace["total_ms"] or 0.0
    lines = [
        f"request {trace['request_id']}  {trace['endpoint']}  model={trace['model']}  status={trace['status']}"
        + (f"  finish_reason={trace['finish_reason']}" if trace.get("finish_reason") else ""),
        f"tokens: prompt={trace['prompt_tokens']} cached={trace['cached_tokens']} "
        f"completion={trace['completion_tokens']}"
        + (f" (reasoning={trace['reasoning_tokens']})" if trace.get("reasoning_tokens") else "")
        + f"  cost=${trace.get('cost_usd', 0.0):.6f}",
        f"ttft={_ms(trace.get('ttft_ms'))}  tpot={_ms(trace.get('tpot_ms'))}  total={total:.2f} ms",
    ]
    if trace.get("error"):
        lines.append(f"error: {trace['error']}")
    if trace.get("cache_explanation"):
        lines.append(f"prefix cache: {trace['cache_explanation']}")
    lines += ["", f"{'stage':<12}{'ms':>10}{'share':>8}  timeline", "-" * (32 + _BAR_WIDTH)]
    offset = 0.0
    for stage in STAGES:
        ms = trace["stages_ms"].get(stage, 0.0)
        share = ms / total if total > 0 else 0.0
        start = int(_BAR_WIDTH * offset / total) if total > 0 else 0
        width = max(1, round(_BAR_WIDTH * share)) if ms > 0 else 0
        bar = " " * min(start, _BAR_WIDTH - width) + "#" * width
        lines.append(f"{stage:<12}{ms:>10.3f}{share:>7.1%}  |{bar:<{_BAR_WIDTH}}|")
        offset += ms
    lines.append(f"{'total':<12}{sum(trace['stages_ms'].values()):>10.2f}{'100.0%' if total else '':>8}")
    return "\n".join(lines)


def render_summary(summary: dict) -> str:
    lines = [f"where the time went over the last {summary['num_requests']} requests "
             f"({summary['num_completed']} completed; shares of their summed end-to-end time)",
             f"{'stage':<12}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'share':>8}", "-" * 50]
    for stage, row in summary["stages"].items():
        lines.append(f"{stage:<12}{row['mean_ms']:>10.2f}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}"
                     f"{row['share']:>8.1%}")
    total = summary["total"]
    lines.append(f"{'total':<12}{total['mean_ms']:>10.2f}{total['p50_ms']:>10.2f}{total['p99_ms']:>10.2f}")
    lines.append(f"TTFT p50 {summary['ttft_p50_ms']:.1f} ms, TPOT p50 {summary['tpot_p50_ms']:.2f} ms")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def safety_of(call, outcome) -> dict | None:
    """The trace's safety entry: what each direction's check found and did, and its time."""
    screening, guard = call.screening, call.guard
    if screening is None and guard is None and not outcome.safety_output_ms and not outcome.safety_output:
        return None
    entry = {}
    if screening is not None:
        entry["input"] = {"categories": list(screening.categories), "action": screening.action,
                          "ms": round(screening.ms, 3)}
    if guard is not None:
        entry.setdefault("input", {})["guard"] = {"categories": list(guard.categories), "ms": round(guard.ms, 3),
                                                 "error": guard.error}
    if outcome.safety_output_ms or outcome.safety_output:
        entry["output"] = {"categories": list(outcome.safety_output), "action": outcome.safety_output_action,
                           "ms": round(outcome.safety_output_ms, 3)}
    return entry
