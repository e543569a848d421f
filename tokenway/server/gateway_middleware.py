"""Stage 1 of every request, around every route (GatewayMiddleware): the stage clock, the
framing check, authentication, the route's body limit, the policy headers, the 500 for a bug,
the call's ledger row and its trace. error_response renders an error in the request's API's
shape (Anthropic's under /v1/messages, else OpenAI's)."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenway.gateway.auth import ADMIN, ANONYMOUS, presents_admin_key, unauthenticated
from tokenway.gateway.call import Answer, Call, CallStart
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.observability.observer import Observer
from tokenway.observability.traces import Trace
from tokenway.protocol.errors import (
    InternalServerError,
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
    TokenwayError,
    anthropic_error_body,
    openai_error_body,
)
from tokenway.protocol.job import GenerationJob
from tokenway.server.direct_routes import DirectRoutes
from tokenway.stages import StageClock

logger = logging.getLogger(__name__)


def error_response(request_path: str, exc: TokenwayError, request_id: str | None = None,
                   status: int | None = None) -> JSONResponse:
    """The error in the path's API's shape; `status`: another than the error's own (a
    routing 405 is an invalid request, answered 405)."""
    body = anthropic_error_body(exc) if request_path.startswith("/v1/messages") else openai_error_body(exc)
    headers = dict(exc.headers)
    if request_id is not None and request_path in GENERATION_PATHS:
        headers["x-request-id"] = request_id
    return JSONResponse(body, status_code=status if status is not None else exc.status, headers=headers)


# The calls that generate: each writes exactly one ledger row and one trace, whatever happens to it.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                              "/v1/embeddings"})
# Routes whose bodies may be large (prompts, token ids) get --max-body-bytes; every other
# route (admin, usage, traces, ...) is capped at SMALL_BODY_BYTES.
LARGE_BODY_PATHS = GENERATION_PATHS | {"/v1/responses/input_tokens", "/v1/messages/count_tokens", "/tokenize",
                                       "/detokenize"}
SMALL_BODY_BYTES = 64 * 1024
# Routes that take a batch's requests whole (a JSONL upload, a message batch): --max-batch-file-bytes.
UPLOAD_PATHS = frozenset({"/v1/files", "/v1/messages/batches"})
# The scope key of a call the server makes to itself (a batch line, server/batch_lines.py): its
# CallStart, made by that in-process code. An ASGI server builds a network request's scope from
# its method, path, query and headers alone, so no request from the network can carry one.
IN_PROCESS_CALL = "tokenway.call_start"


def needs_api_key(path: str) -> bool:
    """The routes behind the API key (or the admin key) when auth is on: what costs model time,
    or shows usage or load."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/engine/stats")


class GatewayMiddleware:
    """Stage 1 of every request: start the stage clock, refuse ambiguous framing, authenticate
    /v1 calls, enforce the route's body limit (Content-Length up front, a running count for
    chunked bodies), put the x-ratelimit-* headers and x-request-id on the response, answer
    anything unexpected with a 500 (never a traceback), and write the call's ledger row: before
    the last byte of the response leaves, or (the client gone) right after; a generation call
    refused by auth gets its row too, queued after the 401. Last, a generation call's trace
    goes to the observer. Nothing here raises once a response has started: an exception out of
    an ASGI app after http.response.start makes the server drop the keep-alive connection.
    A POST on a generation route goes to its endpoint directly (`direct_routes`), any other
    request on to `app`, FastAPI's routing."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, gatekeeper: Gatekeeper | None,
                 observer: Observer | None, admin_key: str | None = None,
                 max_upload_bytes: int | None = None, direct_routes: DirectRoutes | None = None) -> None:
        self.app = app
        self.direct_routes = direct_routes
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes if max_upload_bytes is not None else max_body_bytes
        self.gatekeeper = gatekeeper
        self.observer = observer
        self.admin_key = admin_key  # its bearer is ADMIN wherever the admin may read

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        clock = StageClock()
        path = scope["path"]
        generation_call = scope["method"] == "POST" and path in GENERATION_PATHS
        call: Call | None = None
        status = 0
        try:
            status, call = await self._handle(scope, receive, send, clock, generation_call)
        finally:
            clock.finish()
            if generation_call and self.observer is not None and call is not None and not call.handed_over:
                call.end_as_sent(status)
                outcome = call.outcome
                assert outcome is not None, "end_as_sent makes one where the call had none"
                if not call.deferred:  # a batch line's attempt to run again: traced by the one it ends with
                    cost = self.gatekeeper.call_cost_usd(call, outcome) if self.gatekeeper is not None else 0.0
                    self.observer.record(Trace.of_call(call, outcome, cost))

    async def _handle(self, scope: Scope, receive: Receive, send: Send, clock: StageClock,
                      generation_call: bool) -> tuple[int, Call | None]:
        """Run the request; returns the HTTP status sent (0 if none was) and the call, once authenticated."""
        path = scope["path"]
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if "transfer-encoding" in headers and "content-length" in headers:
            # RFC 9112 6.3: a request smuggling vector when a proxy in front reads it the other way.
            error = InvalidRequestError("The request has both Content-Length and Transfer-Encoding; send one.",
                                        code="ambiguous_framing")
            response = error_response(path, error, CallStart.now(path).request_id)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return error.status, None
        gatekeeper = self.gatekeeper
        # A call the server makes to itself comes authenticated: as the key its CallStart names.
        in_process: CallStart | None = scope.get(IN_PROCESS_CALL)
        principal = ANONYMOUS if in_process is None else in_process.principal
        if gatekeeper is not None and needs_api_key(path) and in_process is None:
            try:
                if presents_admin_key(headers, self.admin_key):
                    principal = ADMIN
                    if generation_call:
                        raise PermissionDeniedError(
                            "The admin key manages this server and reads its usage; it calls no model. Call "
                            "models with an API key (POST /admin/keys or `tokenway keys create`).",
                            code="admin_key_not_for_calls")
                else:
                    principal = gatekeeper.authenticate(headers)
            except TokenwayError as exc:
                if not generation_call:
                    await error_response(path, exc, CallStart.now(path).request_id)(scope, receive, send)
                    return exc.status, None
                # One row per refusal, batched with the others (a flood of 401s is a flood of rows,
                # never of commits), under the key the secret names, billing nothing.
                refused = Call(CallStart.now(path, unauthenticated(headers)), clock)
                refused.end_with_error(exc.status, exc.message)
                try:
                    await error_response(path, exc, refused.request_id)(scope, receive, send)
                finally:
                    gatekeeper.commit_nowait(refused, exc.status)
                return exc.status, refused
        clock.end("auth")
        call = Call(in_process or CallStart.now(path, principal, headers.get("traceparent")), clock)
        scope.setdefault("state", {})["call"] = call
        limit = (self.max_body_bytes if path in LARGE_BODY_PATHS
                 else self.max_upload_bytes if path in UPLOAD_PATHS else SMALL_BODY_BYTES)

        def too_large() -> PayloadTooLargeError:  # made only for a body past the limit
            return PayloadTooLargeError(f"Request body exceeds the limit of {limit} bytes for {path}")

        ledger_keeper = gatekeeper if generation_call else None  # writes the call's one row
        received = 0
        status = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large()
            return message

        async def with_policy_headers(message: Message) -> Message:
            extra = {}
            if call.admission is not None:
                extra.update(call.admission.rate_headers)
            elif gatekeeper is not None and needs_api_key(path):
                # Not admitted through the limiter (a 400, a 429, /v1/models...): still tell the
                # caller where its limits stand, as OpenAI does on every response.
                extra.update(await gatekeeper.rate_headers(principal))
            if generation_call:  # every answer to a generation call names the id to trace it by
                extra.setdefault("x-request-id", call.request_id)
                extra.update(safety_headers(call))
                if (omitted := omitted_tools(call)):
                    extra[OMITTED_TOOLS_HEADER] = ", ".join(omitted)
            if not extra:
                return message
            response_headers = list(message.get("headers", []))
            present = {name.lower() for name, _ in response_headers}
            if b"request-id" in present:  # /v1/messages sends Anthropic's name for it
                extra.pop("x-request-id", None)
            response_headers += [(k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in present]
            return {**message, "headers": response_headers}

        async def send_with_policy(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                try:
                    message = await with_policy_headers(message)
                except Exception:  # a bug: the response goes out all the same, without them
                    logger.exception("response headers on %s", path)
                status = message["status"]
                call.set_answer(answer_of(status, message.get("headers", ())))
            elif ledger_keeper is not None and not message.get("more_body") and not call.committed:
                await ledger_keeper.commit(call, status)
            await send(message)

        try:
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                error = too_large()
                call.end_with_error(error.status, error.message)
                await error_response(path, error)(scope, receive, send_with_policy)
                return error.status, call
            direct = self.direct_routes
            endpoint = direct.endpoint(path) if generation_call and direct is not None else None
            if direct is not None and endpoint is not None:
                await direct(endpoint, scope, limited_receive, send_with_policy)
            else:
                await self.app(scope, limited_receive, send_with_policy)
        except Exception:
            # A bug, not the client's doing: log it whole, answer a plain 500 (with the request
            # id, in the ledger like any other outcome) if nothing was sent yet.
            logger.exception("unhandled error on %s", path)
            call.end_with_error(500, "internal server error")
            if status == 0:
                await error_response(path, InternalServerError("The server had an error processing the request"))(
                    scope, receive, send_with_policy)
        finally:
            if ledger_keeper is not None and not call.committed:
                ledger_keeper.commit_nowait(call, 0)  # the client left before the last byte: a 499
        return status, call


OMITTED_TOOLS_HEADER = "x-tokenway-omitted-tools"


def omitted_tools(call: Call) -> tuple[str, ...]:
    """The tools the caller listed that the model is not shown (a Responses call's web_search, ...)."""
    job = call.job
    return job.omitted_tools if isinstance(job, GenerationJob) else ()


def answer_of(status: int, headers) -> Answer:
    """The Answer a response's head gives: its status, and its Retry-After in seconds
    (retry-after-ms where sent, this server's finer figure; a date or garbage reads as none)."""
    values = {name.lower(): value for name, value in headers if name.lower() in (b"retry-after", b"retry-after-ms")}
    for name, scale in ((b"retry-after-ms", 1000.0), (b"retry-after", 1.0)):
        if name in values:
            try:
                return Answer(status, max(0.0, float(values[name]) / scale))
            except ValueError:
                continue
    return Answer(status)


def safety_headers(call: Call) -> dict[str, str]:
    """What the safety stage found, named (never the text): the input's, and the output's where
    the response starts after it is known (not a stream's)."""
    headers = {}
    screening, guard, outcome = call.screening, call.guard, call.outcome
    if screening is None and guard is None and (outcome is None or not outcome.safety_output):
        return headers  # no policy looked, or it found nothing to name
    found = sorted({*(screening.categories if screening is not None else ()),
                    *(guard.categories if guard is not None else ())})
    if found:
        action = screening.action if screening is not None and screening.categories else "flag"
        headers["x-tokenway-safety-input"] = f"{action}; {','.join(found)}"
    if outcome is not None and outcome.safety_output:
        headers["x-tokenway-safety-output"] = f"{outcome.safety_output_action}; {','.join(outcome.safety_output)}"
    return headers
