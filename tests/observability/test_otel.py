"""OtelExporter against a real OTLP/HTTP receiver on loopback: what a collector gets."""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tokenway.observability.otel import OtelExporter, traces_url
from tokenway.observability.traces import Trace
from tokenway.stages import STAGES

STARTED_AT = 1_750_000_000.25
PARENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Receiver:
    """A minimal OTLP/HTTP collector: keeps every span POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.content_encodings: list[str | None] = []
        self.resource_attributes: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding")
                receiver.content_encodings.append(encoding)
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    receiver.resource_attributes.append(attributes(resource_spans.resource))
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def by_name(self, name: str) -> list[Span]:
        return [span for span in self.spans if span.name == name]


def attributes(item) -> dict:
    return {kv.key: any_value(kv.value) for kv in item.attributes}


def any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def exporter(receiver):
    exporter = OtelExporter(receiver.endpoint, server_address="10.0.0.7", server_port=8123)
    yield exporter
    exporter.shutdown()


def make_trace(request_id: str = "chatcmpl-1", endpoint: str = "/v1/chat/completions", status: int = 200,
               stages_ms: dict[str, float] | None = None, **kwargs) -> Trace:
    if stages_ms is None:
        stages_ms = {"auth": 0.5, "validation": 1.25, "routing": 0.0, "tokenize": 2.0, "limits": 0.25,
                     "queue": 3.5, "prefill": 20.0, "decode": 150.125, "postprocess": 0.0, "billing": 1.5}
    stages_ms = {stage: stages_ms.get(stage, 0.0) for stage in STAGES}
    fields = dict(request_id=request_id, endpoint=endpoint, model="smollm2", key_id="key-7", status=status,
                  started_at=STARTED_AT, stages_ms=stages_ms, total_ms=sum(stages_ms.values()))
    return Trace(**(fields | kwargs))


def children(receiver: Receiver, root: Span) -> list[Span]:
    return sorted((s for s in receiver.spans if s.parent_span_id == root.span_id and s.trace_id == root.trace_id),
                  key=lambda s: s.start_time_unix_nano)


def test_traces_url():
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://otel.example/v1/traces") == "https://otel.example/v1/traces"
    with pytest.raises(ValueError):
        traces_url("127.0.0.1:4318")


def test_completed_chat_is_a_server_span_with_genai_attributes(receiver, exporter):
    trace = make_trace(ttft_ms=27.5, tpot_ms=1.5, stream=True, prompt_tokens=120, cached_tokens=64,
                       completion_tokens=101, finish_reason="stop", cost_usd=0.00125, cache_reason="not_cached",
                       sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 256, "seed": 42, "n": 2})
    exporter.export(trace)
    exporter.shutdown()

    [root] = receiver.by_name("chat smollm2")
    assert root.kind == Span.SPAN_KIND_SERVER
    assert root.parent_span_id == b""
    assert root.start_time_unix_nano == int(STARTED_AT * 1e9)
    assert root.end_time_unix_nano - root.start_time_unix_nano == round(trace.total_ms * 1e6)
    assert root.status.code == Status.STATUS_CODE_UNSET
    assert attributes(root) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "tokenway",
        "gen_ai.system": "tokenway",
        "gen_ai.request.model": "smollm2",
        "gen_ai.response.model": "smollm2",
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.request.stream": True,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.max_tokens": 256,
        "gen_ai.request.seed": 42,
        "gen_ai.request.choice.count": 2,
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 101,
        "gen_ai.usage.cache_read.input_tokens": 64,
        "tokenway.usage.reasoning_tokens": 0,
        "server.address": "10.0.0.7",
        "server.port": 8123,
        "http.response.status_code": 200,
        "tokenway.endpoint": "/v1/chat/completions",
        "tokenway.key_id": "key-7",
        "tokenway.cost_usd": 0.00125,
        "tokenway.ttft_ms": 27.5,
        "tokenway.tpot_ms": 1.5,
        "tokenway.prefix_cache.reason": "not_cached",
    }
    assert receiver.resource_attributes[0]["service.name"] == "tokenway"


def test_stage_spans_are_laid_end_to_end_and_zero_ms_stages_are_absent(receiver, exporter):
    trace = make_trace()
    exporter.export(trace)
    exporter.shutdown()

    [root] = receiver.by_name("chat smollm2")
    stages = children(receiver, root)
    timed = [stage for stage in STAGES if trace.stages_ms[stage] > 0]
    assert [span.name for span in stages] == [f"tokenway.{stage}" for stage in timed]
    assert "tokenway.routing" not in {span.name for span in receiver.spans}
    assert "tokenway.postprocess" not in {span.name for span in receiver.spans}
    assert len(receiver.spans) == 1 + len(timed)
    assert [attributes(span) for span in stages] == [{"tokenway.stage": stage} for stage in timed]
    assert all(span.kind == Span.SPAN_KIND_INTERNAL for span in stages)
    # End to end: each starts where the previous ended, from the root's start to its end.
    assert stages[0].start_time_unix_nano == root.start_time_unix_nano
    for previous, span in zip(stages, stages[1:]):
        assert span.start_time_unix_nano == previous.end_time_unix_nano
    assert stages[-1].end_time_unix_nano == root.end_time_unix_nano
    durations_ns = [span.end_time_unix_nano - span.start_time_unix_nano for span in stages]
    assert sum(durations_ns) == root.end_time_unix_nano - root.start_time_unix_nano
    assert durations_ns == [round(trace.stages_ms[stage] * 1e6) for stage in timed]


def test_text_completion_operation(receiver, exporter):
    exporter.export(make_trace(request_id="cmpl-9", endpoint="/v1/completions"))
    exporter.export(make_trace(request_id="msg-3", endpoint="/v1/messages"))
    exporter.shutdown()

    [completion] = receiver.by_name("text_completion smollm2")
    assert attributes(completion)["gen_ai.operation.name"] == "text_completion"
    assert attributes(completion)["gen_ai.response.id"] == "cmpl-9"
    [message] = receiver.by_name("chat smollm2")
    assert attributes(message)["gen_ai.response.id"] == "msg-3"


def test_traceparent_makes_the_root_a_child_of_the_callers_span(receiver, exporter):
    exporter.export(make_trace(traceparent=f"00-{PARENT_TRACE_ID}-{PARENT_SPAN_ID}-01"))
    exporter.shutdown()

    [root] = receiver.by_name("chat smollm2")
    assert root.trace_id.hex() == PARENT_TRACE_ID
    assert root.parent_span_id.hex() == PARENT_SPAN_ID
    assert all(span.trace_id == root.trace_id for span in receiver.spans)


def test_invalid_traceparent_is_ignored(receiver, exporter):
    exporter.export(make_trace(request_id="a", traceparent="00-not-a-trace-01"))
    exporter.export(make_trace(request_id="b", traceparent=f"00-{'0' * 32}-{PARENT_SPAN_ID}-01"))
    exporter.shutdown()

    roots = receiver.by_name("chat smollm2")
    assert sorted(attributes(root)["gen_ai.response.id"] for root in roots) == ["a", "b"]
    for root in roots:
        assert root.parent_span_id == b""
        assert root.trace_id.hex() not in (PARENT_TRACE_ID, "0" * 32)
        assert len(children(receiver, root)) == 8


def test_rate_limited_request_has_error_type_but_unset_status(receiver, exporter):
    # A 429 is refused at `limits`: the time after the last mark counts to it, nothing after runs.
    trace = make_trace(status=429, stages_ms={"auth": 0.5, "validation": 1.0, "routing": 0.25, "tokenize": 2.0,
                                               "limits": 0.75}, limit_kind="tokens_per_minute",
                       error="rate limit exceeded: tokens per minute")
    exporter.export(trace)
    exporter.shutdown()

    [root] = receiver.by_name("chat smollm2")
    root_attributes = attributes(root)
    assert root_attributes["error.type"] == "429"
    assert root_attributes["http.response.status_code"] == 429
    assert root_attributes["tokenway.limit_kind"] == "tokens_per_minute"
    assert "gen_ai.response.finish_reasons" not in root_attributes
    assert root.status.code == Status.STATUS_CODE_UNSET
    assert [span.name for span in children(receiver, root)] == [
        "tokenway.auth", "tokenway.validation", "tokenway.routing", "tokenway.tokenize", "tokenway.limits"]


def test_server_error_sets_error_status(receiver, exporter):
    exporter.export(make_trace(status=500, error="engine failed"))
    exporter.shutdown()

    [root] = receiver.by_name("chat smollm2")
    assert attributes(root)["error.type"] == "500"
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert root.status.message == "engine failed"


def test_gzip_compression_is_received(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    exporter = OtelExporter(receiver.endpoint + "/v1/traces")
    exporter.export(make_trace())
    exporter.shutdown()
    assert receiver.content_encodings == ["gzip"]
    assert len(receiver.by_name("chat smollm2")) == 1


def test_unsampled_traceparent_sends_no_spans(receiver, exporter):
    # The default sampler follows the caller's decision (W3C sampled flag off -> not recorded).
    exporter.export(make_trace(request_id="a", traceparent=f"00-{PARENT_TRACE_ID}-{PARENT_SPAN_ID}-00"))
    exporter.export(make_trace(request_id="b"))
    exporter.shutdown()
    assert [attributes(root)["gen_ai.response.id"] for root in receiver.by_name("chat smollm2")] == ["b"]
