"""The gateway's HTTP/1.1 client to its upstreams: a keep-alive pool per origin, requests
written in one piece, responses parsed by httptools (llhttp, the parser uvicorn uses) as the
bytes arrive. Every routed call crosses it, so it does as little as a call needs: no
redirects, cookies, proxies or compression (upstream streams must not be batched by gzip).

    pool = ConnectionPool("http://10.0.0.20:8000", max_connections=512, max_keepalive=64, keepalive_expiry=4.0)
    response = await pool.request("POST", "/v1/chat/completions", headers, body)   # after the headers
    async for chunk in response.chunks(): ...     # the body as it arrives (chunked decoded)
    await response.aclose()                        # done: the connection goes back to the pool;
                                                   # unfinished: it is closed, the upstream sees it

Failures are HTTPError (refused, reset, closed early, a malformed response); timeouts are the
caller's (asyncio.timeout around any await). A connection that was idle in the pool and turns
out closed by the server before answering is retried once on a new one, as the request never
reached the server.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

READ_BYTES = 65536
# A response head's size (status line and headers). llhttp hands httptools a header in the
# pieces it arrived in, and httptools joins them with bytes +=: an endless header would be
# quadratic time and unbounded memory.
MAX_HEAD_BYTES = 64 * 1024


class HTTPError(Exception):
    """The upstream could not be reached, or its answer broke off or was not HTTP."""


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def is_reusable(self, now: float, keepalive_expiry: float) -> bool:
        """Still open on both ends (a server's close is seen by the event loop as EOF) and not
        idle past the expiry, below the server's own keep-alive timeout."""
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and now - self.idle_since < keepalive_expiry)

    def close(self) -> None:
        self.writer.close()


class _Parser:
    """httptools' callbacks, collected: status, headers, body pieces, the message's end."""

    __slots__ = ("headers", "name_to_values", "headers_done", "body", "complete", "keep_alive", "parser")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}  # a repeated header's values joined by ", ", once all have come
        self.name_to_values: dict[str, list[str]] = {}
        self.headers_done = False
        self.body: list[bytes] = []
        self.complete = False
        self.keep_alive = False  # llhttp's verdict, read while the message is current
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.name_to_values.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.headers = {name: ", ".join(values) for name, values in self.name_to_values.items()}
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise HTTPError("the upstream switched protocols") from None
        except httptools.HttpParserError as exc:
            raise HTTPError(f"malformed HTTP response: {exc}") from None


class Response:
    """One response, from its headers on. Iterate chunks() once; always aclose()."""

    def __init__(self, pool: ConnectionPool, connection: _Connection, parser: _Parser, method: str) -> None:
        self._pool, self._connection, self._parser = pool, connection, parser
        self.status = parser.parser.get_status_code()
        self.headers: Mapping[str, str] = parser.headers
        # A body that runs until the connection closes (no length, not chunked) ends at EOF.
        self._until_close = (method != "HEAD" and "content-length" not in parser.headers
                             and "chunked" not in parser.headers.get("transfer-encoding", "").lower()
                             and self.status not in (204, 304) and self.status >= 200)
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        parser = self._parser
        while True:
            if parser.body:
                pieces, parser.body = parser.body, []
                for piece in pieces:
                    yield piece
            if parser.complete:
                return
            await self._receive()

    async def read(self, limit: int) -> bytes:
        """The body, up to `limit` bytes (the rest is not read). The loop of chunks(), without an
        async generator: a JSON answer is read whole on every call."""
        parser = self._parser
        body = bytearray()
        while True:
            if parser.body:
                pieces, parser.body = parser.body, []
                for piece in pieces:
                    body += piece
                    if len(body) >= limit:
                        return bytes(body[:limit])
            if parser.complete:
                return bytes(body)
            await self._receive()

    async def _receive(self) -> None:
        """The next bytes of the answer, fed to the parser (the end of a body that runs until
        the connection closes completes it)."""
        try:
            data = await self._connection.reader.read(READ_BYTES)
        except OSError as exc:
            raise HTTPError(f"the connection failed mid-answer: {exc}") from None
        if not data:
            if self._until_close:
                self._parser.complete = True  # and keep_alive stays False: the connection is spent
                return
            raise HTTPError("the upstream closed the connection mid-answer")
        self._parser.feed(data)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        parser = self._parser
        reusable = parser.complete and parser.keep_alive and not parser.body
        self._pool._release(self._connection, reusable)


class ConnectionPool:
    """Connections to one origin (scheme://host:port). max_connections bounds those open at
    once (callers wait for one); max_keepalive those kept idle for reuse."""

    def __init__(self, origin: str, *, max_connections: int, max_keepalive: int, keepalive_expiry: float,
                 connect_timeout: float | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(origin)
        self.host = parts.hostname or ""
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        default_port = 443 if self.tls else 80
        self.host_header = (f"[{self.host}]" if ":" in self.host else self.host) + \
            ("" if self.port == default_port else f":{self.port}")
        self._ssl = (ssl_context or ssl.create_default_context()) if self.tls else None
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[_Connection] = deque()
        self._max_keepalive = max_keepalive
        self._keepalive_expiry = keepalive_expiry
        self._connect_timeout = connect_timeout
        self._closed = False

    async def request(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None = None
                      ) -> Response:
        """Send the request, and return once the response's headers have arrived."""
        head = [f"{method} {target} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        head.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if body is not None:
            head.append(f"Content-Length: {len(body)}\r\n")
        head.append("\r\n")
        request = "".join(head).encode("latin-1") + (body or b"")
        await self._slots.acquire()
        try:
            while True:
                connection, reused = self._take_idle(), True
                if connection is None:
                    connection, reused = await self._connect(), False
                try:
                    return await self._exchange(connection, request, method)
                except _StaleConnection:
                    connection.close()
                    if not reused:
                        raise HTTPError("the upstream closed the connection without answering") from None
                except BaseException:
                    connection.close()
                    raise
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, connection: _Connection, request: bytes, method: str) -> Response:
        connection.writer.write(request)
        parser, num_received = _Parser(), 0
        try:
            await connection.writer.drain()
            while not parser.headers_done:
                data = await connection.reader.read(READ_BYTES)
                if not data:
                    raise _StaleConnection() if not num_received else HTTPError(
                        "the upstream closed the connection mid-answer")
                num_received += len(data)
                parser.feed(data)
                if not parser.headers_done and num_received > MAX_HEAD_BYTES:
                    raise HTTPError(f"the response head is larger than {MAX_HEAD_BYTES} bytes")
        except (ConnectionResetError, BrokenPipeError) as exc:
            if not num_received:
                raise _StaleConnection() from exc
            raise HTTPError(f"the connection failed: {exc}") from None
        except OSError as exc:
            raise HTTPError(f"the connection failed: {exc}") from None
        return Response(self, connection, parser, method)

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recently used: the least likely to have expired
            if connection.is_reusable(now, self._keepalive_expiry):
                return connection
            connection.close()
        return None

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout):  # TimeoutError: the caller's to map
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self._ssl, server_hostname=self.host if self.tls else None,
                    limit=2**20)
        except (OSError, ssl.SSLError) as exc:
            raise HTTPError(f"could not connect to {self.host_header}: {exc.strerror or exc}") from None
        return _Connection(reader, writer)

    def _release(self, connection: _Connection, reusable: bool) -> None:
        self._slots.release()
        if reusable and not self._closed and len(self._idle) < self._max_keepalive:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


class _StaleConnection(Exception):
    """A pooled connection the server had closed: the request never reached it."""
