"""The uvicorn server `tokenway serve` and `tokenway worker` both run.

SIGINT/SIGTERM: stop accepting, give in-flight requests the grace period, abort the rest, exit
0 (uvicorn itself would re-raise the signal after shutting down, exiting 130/143). The ready
line is printed once the socket is bound, before the first request can be answered, so a log
reader never races it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenway.protocol.errors import InvalidRequestError, openai_error_body


class JSONErrorsHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp: the fast parser), whose answer to a request it
    cannot parse is an OpenAI-shaped 400 like every other error, naming what was wrong, rather
    than plain text. llhttp refuses some requests before the app could see them, among them
    one with both Content-Length and Transfer-Encoding (RFC 9112 6.3: a smuggling vector)."""

    def send_400_response(self, msg: str) -> None:
        exc = sys.exc_info()[1]  # uvicorn calls this while handling the parser's error
        detail = str(exc) if exc is not None and str(exc) else msg
        if "transfer-encoding" in detail.lower() and "content-length" in detail.lower():
            error = InvalidRequestError("The request has both Content-Length and Transfer-Encoding; send one.",
                                        code="ambiguous_framing")
        else:
            error = InvalidRequestError(f"The request is not valid HTTP/1.1: {detail}", code="invalid_http_request")
        body = json.dumps(openai_error_body(error)).encode()
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: application/json\r\n", b"content-length: " + str(len(body)).encode() + b"\r\n",
                        b"connection: close\r\n", b"\r\n", body])
        self.transport.write(b"".join(content))
        self.transport.close()


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, announcement: str = "") -> None:
        if config.http == "auto":
            config.http = JSONErrorsHttpToolsProtocol
        super().__init__(config)
        self.announcement = announcement

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

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.announcement:
            print(self.announcement, file=sys.stderr, flush=True)


def run_event_loop(main) -> None:
    """Run a server's main coroutine on uvloop where it is installed (a faster event loop and
    socket layer: every request's I/O runs on it), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
