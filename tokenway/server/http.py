"""HTTP plumbing that knows nothing about models: reading a JSON body into a schema (off
the event loop when it is large), a route's heavy step off the loop for a large body
(offload), racing work against the client going away, and an SSE response that notices a
disconnect at once (not only at its next write)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ParamSpec, TypeVar

import anyio
import pydantic
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenway.protocol.errors import UnsupportedMediaTypeError, truncate
from tokenway.server.body_parser import BodyParser
from tokenway.server.connections import DISCONNECTION, Disconnection

T = TypeVar("T", bound=pydantic.BaseModel)
R = TypeVar("R")
P = ParamSpec("P")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def is_json_media_type(content_type: str | None) -> bool:
    """application/json, application/<anything>+json, any parameters; no header at all too
    (curl and many scripts send none). Not text/plain or a form: a web page can send those
    cross-origin without a preflight, and must not start a generation on a local server."""
    if not content_type:
        return True
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.startswith("application/") and media_type.endswith("+json")


async def parse_body(request: Request, model: type[T], parser: BodyParser) -> T:
    return await _read_body(request, lambda chunks: parser.parse(chunks, model))


async def read_body(request: Request, reader: Callable[[bytes], R], parser: BodyParser) -> R:
    """parse_body with a reader of the JSON body's bytes (BodyParser.parse_with) in place of a model."""
    return await _read_body(request, lambda chunks: parser.parse_with(chunks, reader))


async def _read_body(request: Request, parse: Callable[[AsyncIterator[bytes]], Awaitable[tuple[R, int]]]) -> R:
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got {truncate(content_type or '')!r}")
    try:
        parsed, num_bytes = await parse(request.stream())
    except ClientDisconnect:
        raise ClientDisconnected() from None  # gone before sending the whole body: nothing to answer
    state = request.scope.setdefault("state", {})
    state["body_bytes"] = num_bytes  # the route's next steps choose where to run by it
    clock = state.get("clock")
    if clock is not None:
        clock.end("validation")
    return parsed


async def offload(request: Request, inline_bytes: int, step: Callable[P, R], *args: P.args, **kwargs: P.kwargs
                  ) -> R:
    """Run a route's heavy step (the chat template, tokenizing, the checks that need the
    model): where it is for a body of up to inline_bytes; for a larger one in a worker thread,
    where the tokenizer runs without the GIL, so the event loop keeps serving meanwhile."""
    if request.scope["state"]["body_bytes"] <= inline_bytes:
        return step(*args, **kwargs)
    return await asyncio.to_thread(step, *args, **kwargs)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[R]) -> R:
    """Await `work`; if the client disconnects first, cancel it (which aborts its engine
    requests) and raise ClientDisconnected. `work` runs in the caller's task, not one of its own:
    a call's body is made without a task switch. The server's protocol says when the connection
    is lost (a Disconnection in the scope); under another ASGI server a watcher task waits for
    receive() to say so."""
    task = asyncio.current_task()
    assert task is not None, "awaited in a task"
    disconnected = False

    def on_disconnect() -> None:
        nonlocal disconnected
        disconnected = True
        task.cancel()  # raised at work's await, wherever it has got to

    def on_watcher_done(done: asyncio.Future) -> None:
        if not done.cancelled():
            on_disconnect()

    disconnection: Disconnection | None = request.scope.get(DISCONNECTION)
    watcher: asyncio.Future | None = None
    if disconnection is not None:
        disconnection.watch(on_disconnect)
    else:
        watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        watcher.add_done_callback(on_watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        if disconnected and task.uncancel() == 0:
            raise ClientDisconnected() from None  # our cancel, and no one else's is pending
        raise
    finally:
        if disconnection is not None:
            disconnection.unwatch(on_disconnect)
        if watcher is not None:
            watcher.remove_done_callback(on_watcher_done)
            watcher.cancel()


class EventStreamResponse(StreamingResponse):
    """text/event-stream that stops producing as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        """on_close: awaited once the response ends however it ends, also when `content` was
        never iterated (the client gone before the first byte): what `content` holds is freed."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, headers=headers, media_type=self.media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(scope, receive, send)
        finally:
            if self.on_close is not None:
                await self.on_close()

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream_then_stop() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the socket is gone; the disconnect watcher ends the group
                group.cancel_scope.cancel()

            async def watch() -> None:
                await _wait_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(stream_then_stop)
            group.start_soon(watch)
