"""A Batch API line, run: an in-process call to the app itself, so that the line takes every
step an HTTP call takes (the body's checks, routing, limits and budget, the ledger row, the
trace, the safety stage) and none of them is written twice.

    BatchRunner (tokenway/batches/) ─► LineExecutor(line) ─► POST line.endpoint through the whole
    ASGI app, its scope carrying the line's CallStart (IN_PROCESS_CALL: the batch's key, the
    line's id) ─► GatewayMiddleware opens the Call from it instead of the headers ─► LineOutcome

The line's id becomes CallStart.batch_line: the call runs as service class "batch", and its job's
id (the ledger row's and the trace's) is the line's every time it runs. An attempt refused for
now, before any replica ran it (Call.deferred: a 429 from the key's limits, its batch share or
budget held by calls in flight; a 503 for capacity), is put back with its Retry-After and writes
no row and no trace: the line's one row and trace are those of the attempt it ends with, which
bill what it generated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message

from tokenway.batches.store import BatchLine, LineOutcome
from tokenway.gateway.auth import ANONYMOUS, ANONYMOUS_KEY_ID, Principal
from tokenway.gateway.call import Call, CallStart
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.protocol.errors import (
    AuthenticationError,
    TokenwayError,
    anthropic_error_body,
    openai_error_body,
)
from tokenway.routing.batch_room import batch_room
from tokenway.routing.router import Router
from tokenway.server.gateway_middleware import IN_PROCESS_CALL
from tokenway.server.services import Capacity

logger = logging.getLogger(__name__)

PrincipalOf = Callable[[str], Principal | None]


def principal_of(gatekeeper: Gatekeeper | None) -> PrincipalOf:
    """The key a batch runs as, by its id, as it stands now: None once it is revoked or expired
    (the batch's remaining lines fail with a 401, as its calls would). No gateway: anonymous."""

    def lookup(key_id: str) -> Principal | None:
        if gatekeeper is None or key_id == ANONYMOUS_KEY_ID:
            return ANONYMOUS
        return gatekeeper.keys.principal(key_id)

    return lookup


class LineExecutor:
    """`await executor(line)`: the line's outcome, as its endpoint answered it. Never raises for
    what the line holds; a bug on the way is a 500 outcome, as the HTTP path would answer it."""

    def __init__(self, app: ASGIApp, principal_of: PrincipalOf) -> None:
        self.app = app
        self.principal_of = principal_of

    async def __call__(self, line: BatchLine) -> LineOutcome:
        principal = self.principal_of(line.key_id)
        if principal is None:  # answered as the call itself would be
            return _refused(line.endpoint, AuthenticationError(
                "The API key that made this batch is revoked or expired; its remaining requests are not run."))
        start = CallStart(line.endpoint, principal, f"req_{line.line_id}", time.time(), batch_line=line.line_id)
        try:
            status, request_id, body, call = await self._post(start, json.dumps(line.body).encode())
        except Exception:
            logger.exception("batch line %s", line.line_id)
            return LineOutcome("failed", 500, None, {"code": "internal_error",
                                                     "message": "The server had an error processing the request"})
        # Refused for now, nothing run (the key's limits or budget, no capacity): the runner runs
        # it again after the wait asked for, and this attempt left no row. Any other answer is
        # the line's outcome.
        answer = call.answer if call is not None and call.deferred else None
        retry_after = answer.retry_after_s if answer is not None else None
        return LineOutcome("succeeded" if status < 400 else "failed", status, body, None, request_id, retry_after)

    async def _post(self, start: CallStart, payload: bytes
                    ) -> tuple[int, str | None, dict[str, Any], Call | None]:
        """POST the payload to the app as `start`: (status, the request id answered, the JSON
        body, the Call the gateway made of it, ended)."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": start.endpoint, "raw_path": start.endpoint.encode(), "root_path": "",
            "query_string": b"", "server": None, "client": None, "state": {}, "extensions": {},
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            IN_PROCESS_CALL: start,
        }
        answered = asyncio.Event()
        status, request_id = 0, None
        chunks: list[bytes] = []
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await answered.wait()  # what waits for the client to leave waits until the reply is whole
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() in (b"x-request-id", b"request-id"):  # OpenAI's name, Anthropic's
                        request_id = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    answered.set()

        await self.app(scope, receive, send)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            body = None
        if not isinstance(body, dict) or status == 0:
            raise RuntimeError(f"{start.endpoint} answered {status} with no JSON object")
        # GatewayMiddleware keeps the Call in the scope's state; it has ended by the last byte.
        call = scope["state"].get("call")
        return status, request_id, body, call if isinstance(call, Call) else None


def _refused(endpoint: str, exc: TokenwayError) -> LineOutcome:
    """A line refused before it could run, answered in its endpoint's shape."""
    body = anthropic_error_body(exc) if endpoint.startswith("/v1/messages") else openai_error_body(exc)
    return LineOutcome("failed", exc.status, dict(body), None)


def batch_capacity(capacity: Capacity, router: Router, local_max_num_seqs: int | None) -> Callable[[], int]:
    """How many batch lines may run at once now (BatchRunner's capacity: a total, its lines running
    included): the room the router's replicas leave beside interactive calls (routing/batch_room.py:
    the local engine's sequences, workers' loads, half an upstream's slots), within the batch lines
    this server admits (Capacity counts them apart: they never take an interactive call's place).
    An engine schedules a line as class "batch", so an interactive request arriving later is
    admitted there ahead of it."""

    def room() -> int:
        return min(batch_room(router, local_max_num_seqs), capacity.max_pending_requests)

    return room
