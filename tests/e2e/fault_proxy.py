"""A fault-injecting HTTP proxy (aiohttp, on loopback, in its own thread) between a client and
a real tokenway server. Each request takes the next queued Fault (or `always`, or none) and
the proxy forwards it, answers in the upstream's place, or breaks the answer as told.

    with FaultProxy(server.base_url) as proxy:
        proxy.queue(Fault(status=429, headers={"retry-after": "1.5"}))   # the next request only
        proxy.always = Fault(status=500)                                  # every request, after the queue
        ... client at proxy.base_url ...
        proxy.hits            # (monotonic time, path, fault) of every request, in order

Faults: an answer of its own (`status`, `headers`, `body`); a `delay` before forwarding;
`hang` (never answer, until the client goes away); `cut_after` n SSE events (then the
connection is dropped mid-body, no end chunk); `hang_after` n events (then silence). When the
client goes away the handler is cancelled (handler_cancellation), which closes the upstream
connection: the server sees the disconnect as it would without the proxy.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Self

from aiohttp import ClientSession, ClientTimeout, web

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass(frozen=True)
class Fault:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    delay: float = 0.0
    hang: bool = False
    cut_after: int | None = None
    hang_after: int | None = None


@dataclass(frozen=True)
class Hit:
    time: float
    path: str
    fault: Fault | None


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.faults: deque[Fault] = deque()
        self.always: Fault | None = None
        self.hits: list[Hit] = []
        self.num_disconnects = 0  # requests whose client went away before the answer ended
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def queue(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    def chat_hits(self) -> list[Hit]:
        return [hit for hit in self.hits if hit.path.endswith("/chat/completions")]

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self.faults.popleft() if self.faults else self.always
        self.hits.append(Hit(time.monotonic(), request.path, fault))
        body = await request.read()
        try:
            if fault is not None and fault.delay:
                await asyncio.sleep(fault.delay)
            if fault is not None and fault.hang:
                await asyncio.sleep(3600)
            if fault is not None and fault.status is not None:
                error = {"error": {"message": f"injected {fault.status}", "type": "injected", "code": None}}
                return web.json_response(fault.body or error, status=fault.status, headers=fault.headers)
            return await self._forward(request, body, fault)
        except asyncio.CancelledError:
            self.num_disconnects += 1
            raise

    async def _forward(self, request: web.Request, body: bytes, fault: Fault | None) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
            await response.prepare(request)
            limit = None if fault is None else (fault.cut_after if fault.cut_after is not None else fault.hang_after)
            buffer, num_events = b"", 0
            async for piece in upstream.content.iter_any():
                if limit is None:
                    await response.write(piece)
                    continue
                buffer += piece
                while b"\n\n" in buffer and num_events < limit:
                    event, buffer = buffer.split(b"\n\n", 1)
                    await response.write(event + b"\n\n")
                    num_events += 1
                if num_events >= limit:
                    if fault.cut_after is not None:
                        request.transport.abort()  # mid-body: no end chunk, the client sees a broken read
                        return response
                    await asyncio.sleep(3600)
            if buffer:  # a body that ended before its n-th event (not a stream) goes through whole
                await response.write(buffer)
            await response.write_eof()
            return response
