"""Slow and half-open clients against a real `tokenway serve` (server/connections.py, the
protocol in server/uvicorn_server.py): 20,000 half-open connections, from other addresses or
from the health checker's own, do not stop /health or a chat call; a head that never ends, a
body shorter than its Content-Length and an idle keep-alive connection are closed at their
timeouts; a streamed answer longer than the body timeout is not cut; TLS connections are held
to the same, handshake included. Latencies are printed, not asserted (bench/slowloris_bench.py
measures them)."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time

import httpx
import openai
import pytest

from ..routing.stub_upstream import StubUpstream
from .conftest import Server
from .half_open import Flood, HealthProber

MODEL = "smollm2-135m-instruct"
TIMEOUT = 1.0  # the short servers' header, body and keep-alive timeouts, in seconds
# A test socket waits this long for the server to close: three timeouts, so a close that
# never comes fails the test, and one that is merely late on a busy machine does not.
WAIT = 3 * TIMEOUT + 1
SHORT_TIMEOUTS = ("--header-timeout-seconds", str(TIMEOUT), "--body-timeout-seconds", str(TIMEOUT),
                  "--keep-alive-timeout-seconds", str(TIMEOUT))
OTHER_ADDRESSES = tuple(f"127.0.0.{i}" for i in range(2, 10))


@pytest.fixture(scope="module")
def server(default_model_dir):
    """Default timeouts and caps (from RLIMIT_NOFILE: 18,000 connections, 4,500 per address)."""
    server = Server("--no-embeddings")
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="module")
def quick(default_model_dir):
    server = Server("--no-embeddings", *SHORT_TIMEOUTS)
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


def closed_within(sock: socket.socket, seconds: float = WAIT) -> bytes:
    """Everything the server sends until it closes the connection; fails if it has not
    closed it within `seconds`."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (ConnectionResetError, ssl.SSLEOFError):  # closed without a word (under TLS: no close_notify)
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {seconds} s; it sent {received[:200]!r}")
    return received


def one_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, from a keep-alive connection."""
    sock.settimeout(10)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


# ---- a flood of half-open connections -------------------------------------------------------------


@pytest.mark.parametrize("sources", [OTHER_ADDRESSES, ("127.0.0.1",)], ids=["other-addresses", "checkers-address"])
def test_health_and_a_chat_call_are_served_through_20000_half_open_connections(server, sources):
    """Two processes, each holding 10,000 connections that sent half a request head (together
    more than the server's file-descriptor limit), while /health is checked every 100 ms on a
    new connection and a chat call is made: every check answers 200 and the call succeeds, the
    caps closing the longest-waiting half-open connections to make room."""
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with HealthProber(server.port) as prober:
        floods = [Flood.start(server.port, 10_000, sources[k::2] or sources) for k in range(2)]
        try:
            opened = [flood.wait_opened() for flood in floods]
            reply = chat.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                                 messages=[{"role": "user", "content": "Say hi."}])
            time.sleep(1.0)  # the floods hold their connections while /health is checked
        finally:
            stats = [flood.stop() for flood in floods]
    print(f"\n{sources[0]}...: {opened} {stats}; /health: {prober.summary()}")
    assert sum(o["num_connected"] for o in opened) == 20_000
    assert "connections at the cap" in server.read_log()  # the caps closed them, not the timeouts
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    assert len(prober.statuses) >= 5 and set(prober.statuses) == {200}, prober.statuses


# ---- timeouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half-a-head"])
def test_a_head_that_never_ends_is_closed_at_the_header_timeout(quick, sent):
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(sent)
        assert closed_within(sock) == b""  # no answer: the head never came


def test_a_later_head_that_never_ends_is_closed_too(quick):
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")
        assert closed_within(sock).count(b"HTTP/1.1 200") == 1


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_that_stalls_is_closed_at_the_body_timeout_and_the_call_ends_cleanly(quick, framing):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    if framing == "content-length":
        head = f"Content-Length: {len(body)}"
        sent = body[:10]
    else:
        head = "Transfer-Encoding: chunked"
        sent = b"a\r\n" + body[:10] + b"\r\n"  # one chunk, then nothing
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"{head}\r\n\r\n".encode() + sent)
        assert closed_within(sock) == b""
    assert httpx.get(quick.base_url + "/health", timeout=10).status_code == 200
    log = quick.read_log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_an_idle_keep_alive_connection_is_closed_at_its_timeout_and_not_before(quick):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(request)
        assert one_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT / 4)
        sock.sendall(request)  # well within the keep-alive timeout: the same connection answers
        assert one_response(sock).startswith(b"HTTP/1.1 200")
        assert closed_within(sock) == b""


def test_a_head_larger_than_the_cap_is_a_400_whole_or_trickled(quick):
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000
    for sent in (big + b"\r\n\r\n", big):  # whole in one write; still coming (never ends)
        with socket.create_connection(("127.0.0.1", quick.port)) as sock:
            sock.sendall(sent)
            head, _, payload = closed_within(sock).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head
            assert json.loads(payload)["error"]["code"] == "request_head_too_large"


def test_a_stream_longer_than_the_body_timeout_is_not_cut(quick):
    chat = openai.OpenAI(base_url=quick.base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Count to a thousand."}]
    # As many tokens as this machine makes in two timeouts, so the stream outlasts one here (a
    # long stream's tokens come slower than the first 32: hence the margin, and the bound).
    started = time.monotonic()
    chat.chat.completions.create(model=MODEL, max_tokens=32, temperature=0, messages=messages,
                                 extra_body={"ignore_eos": True})
    num_tokens = min(300, max(32, round(2 * TIMEOUT * 32 / (time.monotonic() - started))))
    stream = chat.chat.completions.create(
        model=MODEL, max_tokens=num_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=messages, extra_body={"ignore_eos": True})
    started = time.monotonic()
    chunks = list(stream)
    elapsed = time.monotonic() - started
    assert elapsed > TIMEOUT, f"the stream took {elapsed:.1f} s: too short to outlast the timeouts"
    assert chunks[-1].usage.completion_tokens == num_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


# ---- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_gateway(tmp_path_factory):
    """A gateway only (no model: it starts in seconds) on HTTPS, before a stub upstream."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with StubUpstream(answer_models=True) as upstream:
        config = folder / "gateway.toml"
        config.write_text(f'[[models]]\nname = "remote"\ncontext_window = 4096\nhealth = {{interval_s = 3600}}\n'
                          f'  [[models.replicas]]\n  kind = "openai"\n  name = "stub"\n  url = "{upstream.base_url}"\n'
                          f'  model = "m"\n')
        server = Server("--config", str(config), "--no-embeddings", "--ssl-certfile", str(cert),
                        "--ssl-keyfile", str(key), *SHORT_TIMEOUTS)
        yield server
        assert server.stop() == 0, server.read_log()[-3000:]


def test_tls_connections_are_timed_from_accept_handshake_included(tls_gateway):
    with socket.create_connection(("127.0.0.1", tls_gateway.port)) as sock:  # never says hello
        assert closed_within(sock) == b""
    with tls_gateway.verify.wrap_socket(socket.create_connection(("127.0.0.1", tls_gateway.port)),
                                        server_hostname="127.0.0.1") as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # half a head, encrypted
        assert closed_within(sock) == b""
    for _ in range(20):  # and whole ones are answered, one handshake after another
        assert httpx.get(tls_gateway.base_url + "/health", verify=tls_gateway.verify, timeout=10).status_code == 200
