"""A Batch API line, run: an in-process call to the app itself, so that the line takes every
step an HTTP call takes (the body's checks, routing, limits and budget, the ledger row, the
trace, the safety stage) and none of them is written twice.

    BatchRunner (tokenway/batches/) ─► LineExecutor(line) ─► POST line.endpoint through the whole
    ASGI app, its scope carrying the line's CallStart (IN_PROCESS_CALL: the batch's key, the
    line's id) ─► GatewayMiddleware opens the Call from it instead of the headers ─► LineOutcome

The line's id becomes CallStart.batch_line: the call runs as service class "batch", and its job's
id (the ledger row's and the trace's) is the line's every time it runs.
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
from tokenway.gateway.call import CallStart
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
# Answers a line outlives: run again after the wait they ask for (the runner bounds it).
RETRIED_STATUSES = frozenset({429, 503})
DEFAULT_RETRY_S = 5.0


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
            status, request_id, retry_after, body = await self._post(start, json.dumps(line.body).encode())
        except Exception:
            logger.exception("batch line %s", line.line_id)
            return LineOutcome("failed", 500, None, {"code": "internal_error",
                                                     "message": "The server had an error processing the request"})
        # Refused for now (the key's limits or budget, no capacity): the runner runs it again later.
        retry_after = retry_after if status in RETRIED_STATUSES else None
        return LineOutcome("succeeded" if status < 400 else "failed", status, body, None, request_id, retry_after)

    async def _post(self, start: CallStart, payload: bytes) -> tuple[int, str | None, float | None, dict[str, Any]]:
        """POST the payload to the app as `start`: (status, the request id answered, its
        Retry-After in seconds, the JSON body)."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": start.endpoint, "raw_path": start.endpoint.encode(), "root_path": "",
            "query_string": b"", "server": None, "client": None, "state": {}, "extensions": {},
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            IN_PROCESS_CALL: start,
        }
        answered = asyncio.Event()
        status, request_id, retry_after = 0, None, None
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
            nonlocal status, request_id, retry_after
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() in (b"x-request-id", b"request-id"):  # OpenAI's name, Anthropic's
                        request_id = value.decode("latin-1")
                    elif name.lower() == b"retry-after":
                        retry_after = seconds_of(value)
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
        return status, request_id, retry_after, body


def seconds_of(value: bytes) -> float:
    """A Retry-After header's seconds (this server always sends a number); a date or garbage
    asks for the default wait."""
    try:
        return max(0.0, float(value))
    except ValueError:
        return DEFAULT_RETRY_S


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
