"""OtelExporter: each Trace as OpenTelemetry spans, sent over OTLP/HTTP (protobuf).

    Observer ── Trace ──► OtelExporter.export (event loop thread: build spans, enqueue)
                              └─► BatchSpanProcessor (its own thread) ─► OTLPSpanExporter ─► collector

One Trace becomes one SERVER span "{gen_ai.operation.name} {model}" (e.g. "chat llama-3")
carrying the GenAI semantic-convention attributes, with one INTERNAL child span per stage
that took time, named "tokenway.{stage}" (e.g. "tokenway.queue"). The children are laid end
to end from the root's start in STAGES order, so their durations add up to the root's.

Only imported when an OTLP endpoint is configured: opentelemetry is not loaded otherwise.
The spans are made after the fact from the Trace's numbers (start_time/end_time given
explicitly), so nothing here runs while the request is in flight.
"""

from __future__ import annotations

import threading

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenway.observability.traces import Trace
from tokenway.stages import STAGES

_TRACES_PATH = "/v1/traces"
_SHUTDOWN_TIMEOUT_S = 5.0

# gen_ai.operation.name per route; every route that makes a Trace is a generation call.
_ENDPOINT_TO_OPERATION = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/completions": "text_completion",
}
_DEFAULT_OPERATION = "chat"

# Trace.sampling key -> GenAI request attribute.
_SAMPLING_TO_ATTRIBUTE = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "max_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
    "n": "gen_ai.request.choice.count",
}


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base ("http://host:4318") or the full traces URL -> the traces URL."""
    url = endpoint.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"OTLP endpoint must be an http:// or https:// URL, got {endpoint!r}")
    return url if url.endswith(_TRACES_PATH) else url + _TRACES_PATH


class OtelExporter:
    """Owns its TracerProvider (never the global one), so tokenway's spans go only to the
    configured endpoint and other instrumentation in the process is left alone."""

    def __init__(self, endpoint: str, service_name: str = "tokenway", headers: dict[str, str] | None = None,
                 server_address: str = "127.0.0.1", server_port: int = 8000) -> None:
        self.url = traces_url(endpoint)
        self._server_attributes = {"server.address": server_address, "server.port": server_port}
        # The sampler is ParentBased(AlwaysOn) unless OTEL_TRACES_SAMPLER says otherwise: a
        # caller's traceparent with the sampled flag off turns off this request's spans too.
        self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url, headers=headers)))
        self._tracer = self._provider.get_tracer("tokenway")
        self._propagator = TraceContextTextMapPropagator()

    def export(self, trace: Trace) -> None:
        """Build the spans of one finished request and queue them; the network send happens
        on the batch processor's thread. Called on the event loop thread."""
        start_ns = int(trace.started_at * 1e9)
        end_ns = start_ns + round(trace.total_ms * 1e6)
        operation = _ENDPOINT_TO_OPERATION.get(trace.endpoint, _DEFAULT_OPERATION)
        root = self._tracer.start_span(
            f"{operation} {trace.model}", context=self._parent_context(trace.traceparent), kind=SpanKind.SERVER,
            attributes=self._root_attributes(trace, operation), start_time=start_ns)
        if trace.status >= 500:
            root.set_status(Status(StatusCode.ERROR, trace.error))

        stage_context = trace_api.set_span_in_context(root)
        timed_stages = [(stage, ms) for stage in STAGES if (ms := trace.stages_ms.get(stage, 0.0)) > 0]
        offset_ms = 0.0
        for i, (stage, ms) in enumerate(timed_stages):
            stage_start_ns = start_ns + round(offset_ms * 1e6)
            offset_ms += ms
            # The stages add up to total_ms; the last one ends exactly at the root's end, so
            # float rounding never leaves a gap or an overhang of a nanosecond.
            stage_end_ns = end_ns if i == len(timed_stages) - 1 else start_ns + round(offset_ms * 1e6)
            span = self._tracer.start_span(f"tokenway.{stage}", context=stage_context, kind=SpanKind.INTERNAL,
                                           attributes={"tokenway.stage": stage}, start_time=stage_start_ns)
            span.end(end_time=stage_end_ns)
        root.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Send what is queued and stop, waiting at most _SHUTDOWN_TIMEOUT_S (the SDK's own
        shutdown waits up to 30 s for an unreachable collector; spans still queued after
        the wait are dropped)."""
        stopper = threading.Thread(target=self._provider.shutdown, name="tokenway-otel-shutdown", daemon=True)
        stopper.start()
        stopper.join(_SHUTDOWN_TIMEOUT_S)

    def _parent_context(self, traceparent: str | None) -> Context:
        # Always an explicit context: never whatever span happens to be current on the loop.
        # An invalid traceparent extracts to the empty context, so the root starts a new trace.
        if not traceparent:
            return Context()
        return self._propagator.extract({"traceparent": traceparent}, context=Context())

    def _root_attributes(self, trace: Trace, operation: str) -> dict:
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "tokenway",
            "gen_ai.system": "tokenway",  # the name before gen_ai.provider.name, for older backends
            "gen_ai.request.model": trace.model,
            "gen_ai.response.model": trace.model,
            "gen_ai.response.id": trace.request_id,
            "gen_ai.request.stream": trace.stream,
            "gen_ai.usage.input_tokens": trace.prompt_tokens,
            "gen_ai.usage.output_tokens": trace.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": trace.cached_tokens,
            "tokenway.usage.reasoning_tokens": trace.reasoning_tokens,
            **self._server_attributes,
            "http.response.status_code": trace.status,
            "tokenway.endpoint": trace.endpoint,
            "tokenway.key_id": trace.key_id,
            "tokenway.cost_usd": trace.cost_usd,
        }
        for key, name in _SAMPLING_TO_ATTRIBUTE.items():
            if (value := trace.sampling.get(key)) is not None:
                attributes[name] = value
        if trace.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [trace.finish_reason]
        if trace.ttft_ms is not None:
            attributes["tokenway.ttft_ms"] = trace.ttft_ms
        if trace.tpot_ms is not None:
            attributes["tokenway.tpot_ms"] = trace.tpot_ms
        if trace.cache_reason is not None:
            attributes["tokenway.prefix_cache.reason"] = trace.cache_reason
        if trace.status >= 400:
            # HTTP semconv: the status code as a string when there is no better-known error type.
            attributes["error.type"] = str(trace.status)
        if trace.limit_kind is not None:
            attributes["tokenway.limit_kind"] = trace.limit_kind
        if trace.error is not None:
            attributes["tokenway.error"] = trace.error
        return attributes
