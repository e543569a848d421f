"""The uvicorn server `tokenway serve` and `tokenway worker` both run.

SIGINT/SIGTERM: stop accepting, give in-flight requests the grace period, abort the rest, exit
0 (uvicorn itself would re-raise the signal after shutting down, exiting 130/143). The ready
line is printed once the socket is bound, before the first request can be answered, so a log
reader never races it.

Every connection is held to a ConnectionPolicy (server/connections.py: read timeouts, the
head's size, caps per client address and in all). uvicorn has a keep-alive timeout only: a
connection that never finishes its request head, or a body shorter than its Content-Length,
would otherwise hold a file descriptor for as long as its sender likes. The timeouts apply to
reading requests, never to writing answers: a long event stream is not cut. Under TLS the
handshake runs inside the protocol (loop.start_tls) rather than in uvicorn's listener, so a
connection is counted and timed from accept, handshake included (as Go's ReadHeaderTimeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import ssl
import sys
import threading
from asyncio import TimerHandle
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenway.protocol.errors import InvalidRequestError, ServiceUnavailableError, TokenwayError, openai_error_body
from tokenway.server.connections import (
    DISCONNECTION,
    ConnectionPolicy,
    ConnectionTable,
    Disconnection,
    raise_fd_limit,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


def error_response_bytes(error: TokenwayError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole OpenAI-shaped error response that closes the connection, for the protocol to
    write before (or instead of) the app."""
    body = json.dumps(openai_error_body(error)).encode()
    content = [STATUS_LINE[error.status]]
    for name, value in default_headers:
        content.extend([name, b": ", value, b"\r\n"])
    content.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in error.headers.items())
    content.extend([b"content-type: application/json\r\n", b"content-length: " + str(len(body)).encode() + b"\r\n",
                    b"connection: close\r\n", b"\r\n", body])
    return b"".join(content)


class JSONErrorsHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp: the fast parser), whose answer to a request it
    cannot parse is an OpenAI-shaped 400 like every other error, naming what was wrong, rather
    than plain text. llhttp refuses some requests before the app could see them, among them
    one with both Content-Length and Transfer-Encoding (RFC 9112 6.3: a smuggling vector)."""

    def send_400_response(self, msg: str) -> None:
        exc = sys.exc_info()[1]  # uvicorn calls this while handling the parser's error
        detail = str(exc) if exc is not None and str(exc) else msg
        if exc is not None and isinstance(exc.__context__, TokenwayError):
            error = exc.__context__  # raised by one of this protocol's parser callbacks
        elif "transfer-encoding" in detail.lower() and "content-length" in detail.lower():
            error = InvalidRequestError("The request has both Content-Length and Transfer-Encoding; send one.",
                                        code="ambiguous_framing")
        else:
            error = InvalidRequestError(f"The request is not valid HTTP/1.1: {detail}", code="invalid_http_request")
        self.send_error_and_close(error)

    def send_error_and_close(self, error: TokenwayError) -> None:
        self.transport.write(error_response_bytes(error, self.server_state.default_headers))
        self.transport.close()


class HeadWithBody:
    """One response's view of its connection's transport, sending a head with a Content-Length
    together with the body's first bytes: uvicorn writes the status line and headers apart from
    the body, and two send(2) calls are two TCP segments and two wake-ups of the client (and a
    chance for it to preempt the server between them) for one JSON response. A streamed head
    (chunked) goes at once; a held head goes with the next write, or before the connection
    closes (a response that failed after its head: as uvicorn would have sent it)."""

    __slots__ = ("transport", "head")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.head: bytes | None = None  # held until the body's first write
        # (None also once written: a response holds one head, its first write)

    def write(self, data: bytes) -> None:
        head = self.head
        if head is not None:
            self.head = None
            self.transport.writelines((head, data))  # one writev(2)
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 ") \
                and b"\r\ncontent-length: " in data:
            self.head = data
        else:
            self.transport.write(data)

    def close(self) -> None:
        head, self.head = self.head, None
        if head is not None:
            self.transport.write(head)
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


@dataclass(frozen=True, slots=True)
class ConnectionGuard:
    """What every connection of one server shares: the policy (resolved: both caps set), the
    table counting connections, and the TLS context the protocol handshakes with (None: plain)."""

    policy: ConnectionPolicy
    table: ConnectionTable
    tls: ssl.SSLContext | None


class GuardedHttpToolsProtocol(JSONErrorsHttpToolsProtocol):
    """JSONErrorsHttpToolsProtocol held to its server's ConnectionGuard.

    Until its first request head is complete a connection is `opening`: its bytes are only
    collected (up to max_head_bytes) and the table closes it at the header timeout, or earlier
    to make room. uvicorn's half of the protocol (its parser with eight bound callbacks, flow
    control, the request scope) is made only then: an opening connection is 6 objects the
    garbage collector walks on each full collection rather than 25 (with 18,000 held, a full
    collection took 60-100 ms rather than 590), and is accepted in less of the event loop's
    time (20,000 from two flooding processes were open in ~2 s rather than 5-7). After that:
    a later request's head is timed from its first byte and capped in size, its body timed
    once it is pending, and an idle connection is evictable again. A stalled body closes the
    connection: the app's receive() then returns http.disconnect, as for a client that left."""

    def __init__(self, config, server_state, app_state, _loop=None, *, guard: ConnectionGuard) -> None:
        # HttpToolsProtocol.__init__ runs in _open(), once a request head has arrived.
        self.config, self.server_state, self.app_state = config, server_state, app_state
        self.loop = _loop or asyncio.get_event_loop()
        self._guard = guard
        self._opening = True
        self._received = bytearray()  # while opening: the bytes so far
        self._socket_transport: asyncio.Transport | None = None
        self._transport: asyncio.Transport | None = None  # the socket's, or under TLS the one over it
        self._head_timer: TimerHandle | None = None  # a later request's head
        self._body_timer: TimerHandle | None = None
        self._num_heads = 0
        self._reading_head = True  # the next bytes belong to a request head
        self._reading_body = False
        self._num_head_bytes = 0
        self._lost = False

    # -- the connection's life ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket_transport = transport
        peer = transport.get_extra_info("peername")
        client = peer[0] if isinstance(peer, tuple) else ""  # a Unix socket's clients are one
        if not self._guard.table.admit(self, client, self.loop.time()):
            if self._guard.tls is None:
                refusal = ServiceUnavailableError("The server has too many connections open; retry shortly.",
                                                  retry_after=1)
                transport.write(error_response_bytes(refusal, self.server_state.default_headers))
                transport.close()
            else:
                transport.abort()
            return
        tls = self._guard.tls
        if tls is None:
            self._transport = transport
        else:
            self._start_tls(transport, tls)

    def _start_tls(self, transport: asyncio.Transport, tls: ssl.SSLContext) -> None:
        """Hands the socket to the TLS layer now, inside connection_made. start_tls is a
        coroutine, and a task would take its first step an event-loop iteration later: by then
        uvloop, which starts reading once connection_made returns, may have given the client's
        hello to this protocol instead, and the handshake would wait for it in vain. So its
        first step (pause reading, swap the protocol) runs here, and the rest when the
        handshake's future is done."""
        handshake = self.loop.start_tls(transport, self, tls, server_side=True,
                                        ssl_handshake_timeout=self._guard.policy.header_timeout_seconds)
        try:
            waiter = handshake.send(None)  # the future of the handshake's end
        except BaseException:
            handshake.close()
            raise
        waiter.add_done_callback(lambda _: self._end_tls_handshake(handshake, transport))

    def _end_tls_handshake(self, handshake, transport: asyncio.Transport) -> None:
        try:
            handshake.send(None)
        except StopIteration as done:
            if not self._lost:  # else it closed between the handshake's end and now
                self._transport = done.value
            return
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001  # failed, timed out, abandoned
            logger.debug("TLS handshake with %s failed: %r", transport.get_extra_info("peername"), exc)
            transport.abort()
            return
        raise RuntimeError("start_tls awaited something other than its handshake")

    def _open(self) -> None:
        """The first request head is complete: make uvicorn's half and hand it the bytes."""
        received, self._received = bytes(self._received), bytearray()
        self._opening = False
        HttpToolsProtocol.__init__(self, self.config, self.server_state, self.app_state, self.loop)
        assert self._transport is not None, "a head arrives only over an open transport"
        super().connection_made(self._transport)
        self.data_received(received)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._guard.table.remove(self)
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        if not self._opening:
            cycle = self.cycle
            super().connection_lost(exc)
            if cycle is not None and cycle.disconnected:  # lost before its response was complete
                disconnection = cycle.scope.get(DISCONNECTION)
                if disconnection is not None:
                    disconnection.fire()

    def evict(self) -> None:
        """The table closes this connection: to make room, or at the header timeout."""
        self._drop()

    def _drop(self) -> None:
        transport = self._transport or self._socket_transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():
            transport.close()  # the last answer is still going out to a slow reader: let it
        else:
            transport.abort()  # now, not after a TLS close_notify exchange the peer may never finish

    def pause_writing(self) -> None:
        if not self._opening:  # while opening there is no flow control yet, nor anything of ours to hold
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self._opening:
            super().resume_writing()

    # -- reading requests --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._opening:
            self._collect(data)
            return
        if self._reading_head:
            self._num_head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._reading_head and self._num_head_bytes > self._guard.policy.max_head_bytes:
            self.send_error_and_close(self._head_too_large())  # still coming: refused before it is whole
        elif self._reading_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self._guard.policy.body_timeout_seconds, self._on_body_timeout)

    def _collect(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return  # refused or dropped: nothing more is read
        received = self._received
        search_from = max(0, len(received) - 3)
        received += data
        # A bare LF (llhttp's 400) ends the wait too, so its sender hears why at once.
        if received.find(b"\r\n\r\n", search_from) >= 0 or data.count(b"\n") != data.count(b"\r\n"):
            self._open()
        elif len(received) > self._guard.policy.max_head_bytes:
            self._transport.write(error_response_bytes(self._head_too_large(), self.server_state.default_headers))
            self._transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._num_heads:  # a later request's head: timed from its first byte (the first one's by the table)
            self._head_timer = self._head_timer or self.loop.call_later(
                self._guard.policy.header_timeout_seconds, self._drop)

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        num_head_bytes = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if num_head_bytes > self._guard.policy.max_head_bytes:  # arrived whole in one read
            raise self._head_too_large()  # the parser stops; send_400_response answers with it
        self._num_heads += 1
        self._reading_head, self._reading_body, self._num_head_bytes = False, True, 0
        self._guard.table.mark_active(self)
        existing_cycle = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not existing_cycle:
            cycle.scope[DISCONNECTION] = Disconnection()  # pyright: ignore[reportGeneralTypeIssues]
            if self.scope["method"] != "HEAD":  # HEAD: no body
                cycle.transport = HeadWithBody(self.transport)  # pyright: ignore[reportAttributeAccessIssue]

    def _head_too_large(self) -> InvalidRequestError:
        return InvalidRequestError(f"The request head is larger than {self._guard.policy.max_head_bytes} bytes.",
                                   code="request_head_too_large")

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._reading_head, self._reading_body, self._num_head_bytes = True, False, 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # idle: nothing pipelined waits its turn
            self._guard.table.mark_idle(self)

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            # The server, not the client, is holding the body back: its buffer is full, a
            # pipelined request waits its turn, or the app has not asked for the body yet.
            self._body_timer = self.loop.call_later(self._guard.policy.body_timeout_seconds, self._on_body_timeout)
            return
        self._drop()  # connection_lost then tells the app: receive() returns http.disconnect


class Server(uvicorn.Server):
    """uvicorn's server with tokenway's protocol, its signals and its ready line. The soft
    RLIMIT_NOFILE is raised to the hard one here, and the policy's caps derived from it."""

    def __init__(self, config: uvicorn.Config, announcement: str = "",
                 policy: ConnectionPolicy = ConnectionPolicy()) -> None:
        config.http = JSONErrorsHttpToolsProtocol  # startup() binds it to this server's guard
        # tokenway serves no WebSocket; an upgraded connection would leave the guard's reach.
        config.ws = "none"
        policy = self.policy = policy.resolved(raise_fd_limit())
        # uvicorn's annotation says int; it hands the value to call_later, which takes any seconds.
        config.timeout_keep_alive = policy.keep_alive_timeout_seconds  # pyright: ignore[reportAttributeAccessIssue]
        max_connections, max_per_client = policy.max_connections, policy.max_connections_per_client
        assert max_connections is not None and max_per_client is not None, "resolved() sets every cap"
        self.connection_table = ConnectionTable(max_connections, max_per_client, policy.max_opening_connections)
        super().__init__(config)
        self.announcement = announcement
        self.on_started: Callable[[], None] | None = None  # once bound, after the ready line

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait for the grace period
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        # The handler stays for the rest of the process (uvicorn restores the default one when
        # serving ends): a second SIGTERM while the ledger, the spans and the engine process
        # are flushed and stopped must not kill the server half-way through them.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
        yield

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop ticks every 0.1 s: the header timeout's resolution.
        now = asyncio.get_running_loop().time()
        self.connection_table.close_expired(accepted_before=now - self.policy.header_timeout_seconds)
        return await super().on_tick(counter)

    async def startup(self, sockets=None) -> None:
        config = self.config  # loaded by now: config.ssl is the context uvicorn built
        tls, config.ssl = config.ssl, None  # the listener stays plain; the protocol handshakes
        guard = ConnectionGuard(self.policy, self.connection_table, tls)
        # uvicorn's annotation says a class; it only calls it, as asyncio calls any protocol factory.
        config.http_protocol_class = functools.partial(  # pyright: ignore[reportAttributeAccessIssue]
            GuardedHttpToolsProtocol, guard=guard)
        try:
            await super().startup(sockets=sockets)
        finally:
            config.ssl = tls
        if self.started and self.announcement:
            print(self.announcement, file=sys.stderr, flush=True)
        if self.started and self.on_started is not None:
            self.on_started()


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a server's main coroutine on uvloop where it is installed (a faster event loop and
    socket layer: every request's I/O runs on it), else asyncio's own; its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
