"""Upstreams that send too much, through a real gateway (`tokenway serve --config`, no model):
an endless event-stream line, a 300 MB JSON answer (to a streamed caller, and to one whose
upstream call is not streamed), an endless response head, a 300 MB error body. Each call ends
in a 502 naming the cause, the gateway stops reading after what the cap allows (the upstream
counts what it could send), and /health answers throughout, four such upstreams at once
included (its latencies printed, not asserted). The upstream (abusive_upstream.py) runs in its
own process. The decoder's own test checks that an open line's pieces are scanned once each,
however long it grows."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tokenway.routing import sse_decoder
from tokenway.routing.sse_decoder import EventTooLargeError, SSEDecoder, SSEEvent
from tokenway.routing.upstream import ConnectionLimits

from ..e2e.conftest import Server
from ..e2e.half_open import HealthProber
from .abusive_upstream import AbusiveUpstream

MAX_EVENT_CHARS = sse_decoder.MAX_EVENT_CHARS
MAX_ANSWER_BYTES = ConnectionLimits().max_answer_bytes

CONFIG_MODEL = """
[[models]]
name = "{name}"
context_window = 4096
timeout_s = 30
breaker = {{failure_threshold = 1000000}}
health = {{interval_s = 3600}}
  [[models.replicas]]
  kind = "openai"
  name = "{name}-replica"
  url = "{url}"
  model = "{mode}"
"""
ENDLESS = [f"endless-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with AbusiveUpstream() as upstream:
        config = tmp_path_factory.mktemp("abuse") / "gateway.toml"
        models = [(name, "endless-line") for name in ENDLESS] + [
            (mode, mode) for mode in ("huge-json", "endless-head", "huge-error")]
        config.write_text("".join(CONFIG_MODEL.format(name=name, mode=mode, url=upstream.base_url)
                                  for name, mode in models))
        server = Server("--config", str(config), "--no-embeddings")
        try:
            yield server, upstream
        finally:
            assert server.stop() == 0, server.read_log()[-3000:]


def chat(server: Server, model: str, stream: bool = False) -> httpx.Response:
    """A refusal before the first token is a JSON answer with its status, streamed caller or not;
    only a streamed caller's upstream is sent stream=true."""
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "max_tokens": 4, "stream": stream,
                            "messages": [{"role": "user", "content": "hi"}]})


def test_four_endless_lines_end_in_502s_while_health_answers(gateway):
    server, _ = gateway
    deadline = time.monotonic() + 3.0

    def calls(model: str) -> list[httpx.Response]:
        responses = []
        while time.monotonic() < deadline:
            responses.append(chat(server, model, stream=True))
        return responses

    with HealthProber(server.port, interval=0.05) as prober, ThreadPoolExecutor(len(ENDLESS)) as pool:
        responses = [r for rs in pool.map(calls, ENDLESS) for r in rs]
    print(f"\n{len(responses)} calls to four endless lines; /health: {prober.summary()}")
    assert responses and {r.status_code for r in responses} == {502}
    messages = {r.json()["error"]["message"] for r in responses}
    assert all(f"a line longer than {MAX_EVENT_CHARS} characters" in m and "-replica" in m for m in messages), messages
    assert len(prober.statuses) >= 10 and set(prober.statuses) == {200}, prober.statuses


@pytest.mark.parametrize(("model", "stream", "cause"), [
    ("huge-json", True, f"a line longer than {MAX_EVENT_CHARS} characters"),
    ("huge-json", False, f"more than {MAX_ANSWER_BYTES} bytes (max_answer_bytes)"),
    (ENDLESS[0], False, f"more than {MAX_ANSWER_BYTES} bytes (max_answer_bytes)"),
    ("endless-head", False, "the response head is larger than 65536 bytes"),
    ("huge-error", False, "failed (HTTP 500)"),
])
def test_a_huge_answer_is_a_502_naming_it_after_a_bounded_read(gateway, model, stream, cause):
    server, upstream = gateway
    num_sent_before = upstream.num_bytes_sent()
    with HealthProber(server.port, interval=0.05) as prober:
        response = chat(server, model, stream)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert cause in error["message"] and error["type"] == "upstream_error", error
    # Of the 300 MB it would send: a cap's worth (a whole answer's, read unstreamed), and what
    # the sockets' buffers hold.
    cap = MAX_ANSWER_BYTES if "max_answer_bytes" in cause else 0
    assert upstream.num_bytes_sent() - num_sent_before < cap + 16 * 2**20
    assert set(prober.statuses) <= {200}, prober.statuses


# ---- the decoder, alone ------------------------------------------------------------------------------


def test_an_open_line_is_scanned_once_however_long_it_grows(monkeypatch):
    """The decoder looks for line ends in each character once: 1,000 pieces of an unended
    line cost 1,000 pieces of scanning, not the 500,000 of re-scanning the whole line each time."""
    num_scanned = 0
    split_lines = sse_decoder.split_lines

    def counting_split_lines(text: str) -> list[str]:
        nonlocal num_scanned
        num_scanned += len(text)
        return split_lines(text)

    monkeypatch.setattr(sse_decoder, "split_lines", counting_split_lines)
    decoder = SSEDecoder(max_event_chars=10**6)
    pieces = ["data: "] + ["x" * 999] * 1000
    assert [event for piece in pieces for event in decoder.feed(piece)] == []
    assert decoder.feed("\r\n\n") == [SSEEvent("x" * 999_000)]
    assert num_scanned == sum(map(len, pieces)) + 3
    with pytest.raises(EventTooLargeError, match="a line longer than 10 characters"):
        SSEDecoder(max_event_chars=10).feed("data: xxxx" + "x" * 5)
    with pytest.raises(EventTooLargeError, match="an event larger than 10 characters"):
        SSEDecoder(max_event_chars=10).feed("data: 12345\ndata: 67890\n")
