"""OTel export benchmark: what OtelExporter.export costs per request, against a real collector.

    python bench/otel_bench.py                 # 2000 traces per run, 1000 traces/s
    python bench/otel_bench.py --traces 5000 --rate 2000

A minimal OTLP/HTTP collector runs in a child process (it decodes every request and counts
spans, so its CPU is not this process's). Each trace has all ten stages > 0 ms, so it is
eleven spans: the worst case. Runs:

    off        the server without an exporter: the `if otel is not None` it pays per request
    ring       TraceRing.add, what every request pays already (the peer)
    on         export() with the default exporter (no compression)
    on gzip    export() with OTEL_EXPORTER_OTLP_TRACES_COMPRESSION=gzip
    burst      export() back to back, no pacing: what the batch queue (2048 spans) drops

Paced runs send traces in bursts of 10 at --rate traces/s, as a busy server's event loop would.
Per run: export() time on the calling thread (the event loop's cost), mean/p50/p99 in µs;
process CPU per trace including the batch processor's thread (protobuf encoding and the
HTTP POST, which contend for the GIL with the loop), measured to the end of shutdown(); and
spans the collector received out of those sent.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway.observability.traces import Trace, TraceRing  # noqa: E402
from tokenway.stages import STAGES  # noqa: E402

BURST = 10

COLLECTOR = r"""
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import gzip
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

num_spans = 0
lock = threading.Lock()

class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        global num_spans
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with lock:
            num_spans += count
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        global num_spans
        with lock:
            body, num_spans = str(num_spans).encode(), 0
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def make_trace(i: int) -> Trace:
    stages_ms = {stage: 0.5 + 0.1 * n for n, stage in enumerate(STAGES)}
    return Trace(request_id=f"chatcmpl-{i}", endpoint="/v1/chat/completions", model="smollm2", key_id="key-1",
                 status=200, started_at=time.time(), stages_ms=stages_ms, total_ms=sum(stages_ms.values()),
                 ttft_ms=12.5, tpot_ms=1.25, stream=True, prompt_tokens=512, cached_tokens=256,
                 completion_tokens=128, finish_reason="stop", cost_usd=0.0004, cache_reason="not_cached",
                 sampling={"temperature": 0.7, "top_p": 0.95, "max_tokens": 128, "seed": 7, "n": 1},
                 traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(name: str, sink, traces: list[Trace], rate: float | None, finish=None,
        collector: str | None = None) -> None:
    """Call sink(trace) for every trace (paced at `rate` traces/s in bursts, or back to back)."""
    durations_us = []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for i, trace in enumerate(traces):
        if rate is not None and i % BURST == 0:
            delay = wall_start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t0 = time.perf_counter_ns()
        sink(trace)
        durations_us.append((time.perf_counter_ns() - t0) / 1e3)
    if finish is not None:
        finish()
    cpu_us = (time.process_time() - cpu_start) * 1e6 / len(traces)
    line = (f"{name:<9} {statistics.fmean(durations_us):8.1f} {percentile(durations_us, 50):8.1f}"
            f" {percentile(durations_us, 99):8.1f} {cpu_us:9.1f}")
    if collector is not None:
        num_received = int(urllib.request.urlopen(collector, timeout=10).read())
        line += f"   {num_received}/{len(traces) * (1 + len(STAGES))}"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=1000.0, help="traces per second in the paced runs")
    args = parser.parse_args()
    # The burst run overflows the queue on purpose; one warning per dropped span is noise here.
    logging.getLogger("opentelemetry").setLevel(logging.ERROR)

    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = f"http://127.0.0.1:{collector.stdout.readline().strip()}"
        from tokenway.observability.otel import OtelExporter

        print(f"{args.traces} traces of {1 + len(STAGES)} spans, paced at {args.rate:.0f}/s except burst")
        print(f"{'run':<9} {'mean µs':>8} {'p50 µs':>8} {'p99 µs':>8} {'CPU µs/tr':>9}   spans received")
        otel = None
        run("off", lambda trace: otel is not None and otel.export(trace), [make_trace(i) for i in range(args.traces)],
            args.rate)
        ring = TraceRing()
        run("ring", ring.add, [make_trace(i) for i in range(args.traces)], args.rate)
        for name, compression, rate in (("on", None, args.rate), ("on gzip", "gzip", args.rate),
                                        ("burst", None, None)):
            if compression:
                os.environ["OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"] = compression
            else:
                os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", None)
            exporter = OtelExporter(endpoint)
            run(name, exporter.export, [make_trace(i) for i in range(args.traces)], rate, exporter.shutdown,
                endpoint + "/count")
    finally:
        collector.terminate()
        collector.wait(5)


if __name__ == "__main__":
    main()
