"""HTTP plumbing that knows nothing about models: reading a JSON body into a schema,
racing work against the client going away, and an SSE response that notices a
disconnect at once (not only at its next write)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
import pydantic
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenway.protocol.errors import InvalidRequestError, from_validation_error

T = TypeVar("T", bound=pydantic.BaseModel)


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def parse_body(request: Request, model: type[T]) -> T:
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientDisconnected() from None  # gone before sending the whole body: nothing to answer
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"Request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"Request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("Request body must be a JSON object")
    try:
        parsed = model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    clock = request.scope.get("state", {}).get("clock")
    if clock is not None:
        clock.end("validation")
    return parsed


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it (which aborts its engine
    requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class EventStreamResponse(StreamingResponse):
    """text/event-stream that stops producing as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, headers=headers, media_type=self.media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
