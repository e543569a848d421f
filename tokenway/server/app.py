"""The ASGI app: routes, the error boundary, the body-size limit and the stage clock.

Every error a client can see comes from the tree in protocol/errors.py, rendered
OpenAI-shaped (Anthropic-shaped under /v1/messages); anything unexpected becomes a 500
with a plain message while the traceback goes to the log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenway.billing.ledger import LedgerUnavailable
from tokenway.gateway.auth import ADMIN, ANONYMOUS, presents_admin_key, unauthenticated
from tokenway.gateway.call import Call, CallStart
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.observability.observer import Observer
from tokenway.observability.traces import Trace
from tokenway.protocol import anthropic as anthropic_schema
from tokenway.protocol import openai as openai_schema
from tokenway.protocol.embeddings import EmbeddingRequest
from tokenway.protocol.errors import (
    InternalServerError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ServiceUnavailableError,
    TokenwayError,
    anthropic_error_body,
    from_validation_error,
    openai_error_body,
)
from tokenway.safety.moderations import ModerationRequest, moderation_response
from tokenway.server import anthropic_api, openai_api
from tokenway.server.admin_api import admin_router
from tokenway.server.embeddings_api import create_embeddings
from tokenway.server.http import ClientDisconnected, EventStreamResponse, parse_body
from tokenway.server.observability_api import observability_router
from tokenway.server.serving import ServerState
from tokenway.stages import StageClock

logger = logging.getLogger(__name__)


def error_response(request_path: str, exc: TokenwayError, request_id: str | None = None) -> JSONResponse:
    body = anthropic_error_body(exc) if request_path.startswith("/v1/messages") else openai_error_body(exc)
    headers = dict(exc.headers)
    if request_id is not None and request_path in GENERATION_PATHS:
        headers["x-request-id"] = request_id
    return JSONResponse(body, status_code=exc.status, headers=headers)


# The calls that generate: each writes exactly one ledger row and one trace, whatever happens to it.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/embeddings"})
# Routes whose bodies may be large (prompts, token ids) get --max-body-bytes; every other
# route (admin, usage, traces, ...) is capped at SMALL_BODY_BYTES.
LARGE_BODY_PATHS = GENERATION_PATHS | {"/tokenize", "/detokenize"}
SMALL_BODY_BYTES = 64 * 1024


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
    an ASGI app after http.response.start makes the server drop the keep-alive connection."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, gatekeeper: Gatekeeper | None,
                 observer: Observer | None, admin_key: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
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
            if generation_call and self.observer is not None and call is not None:
                call.end_as_sent(status)
                cost = self.gatekeeper.cost_usd(call.model, call.outcome) if self.gatekeeper is not None else 0.0
                self.observer.record(Trace.of_call(call, call.outcome, cost))

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
        principal = ANONYMOUS
        if gatekeeper is not None and needs_api_key(path):
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
        call = Call(CallStart.now(path, principal, headers.get("traceparent")), clock)
        scope.setdefault("state", {})["call"] = call
        limit = self.max_body_bytes if path in LARGE_BODY_PATHS else SMALL_BODY_BYTES
        too_large = PayloadTooLargeError(f"Request body exceeds the limit of {limit} bytes for {path}")
        ledgered = gatekeeper is not None and generation_call
        received = 0
        status = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large
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
            elif ledgered and not message.get("more_body") and not call.committed:
                await gatekeeper.commit(call, status)
            await send(message)

        try:
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                call.end_with_error(too_large.status, too_large.message)
                await error_response(path, too_large)(scope, receive, send_with_policy)
                return too_large.status, call
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
            if ledgered and not call.committed:
                gatekeeper.commit_nowait(call, 0)  # the client left before the last byte: a 499
        return status, call


def _schema_extra(model: type) -> dict[str, Any]:
    """An OpenAPI requestBody for a route that parses its own body (so that malformed JSON,
    bad UTF-8 and schema errors all get tokenway's error shape)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tokenway", version="0.1.0", description="OpenAI- and Anthropic-compatible LLM API")
    app.state.tokenway = state
    request_models = [openai_schema.ChatCompletionRequest, openai_schema.CompletionRequest,
                      anthropic_schema.MessagesRequest, EmbeddingRequest, openai_schema.TokenizeRequest,
                      openai_schema.DetokenizeRequest]

    @app.exception_handler(TokenwayError)
    async def on_tokenway_error(request: Request, exc: TokenwayError) -> JSONResponse:
        call_of(request).end_with_error(exc.status, exc.message, getattr(exc, "limit_kind", None))
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, from_validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error: TokenwayError = NotFoundError(f"No route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            error = InvalidRequestError(f"Method {request.method} is not allowed on {request.url.path}")
            error.status = 405
        else:
            error = InvalidRequestError(str(exc.detail))
            error.status = exc.status_code
        return error_response(request.url.path, error)

    @app.exception_handler(ClientDisconnected)
    async def on_client_gone(request: Request, exc: ClientDisconnected) -> Response:
        call_of(request).end_with_error(499, "client disconnected")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, InternalServerError("The server had an error processing the request"))

    def call_of(request: Request) -> Call:
        return request.scope["state"]["call"]

    async def openai_call(request: Request, schema, prepare, respond_json, respond_stream) -> Response:
        """Chat and completions alike: parse, prepare (the adaptor makes the job, and what else
        its response needs), admit, then the JSON response or the OpenAI-framed stream."""
        body = await parse_body(request, schema, state.body_parser)
        call = call_of(request)
        generation, *extra = await state.prepare(request, prepare, state, body, call)
        await state.guard(call)
        await state.admit(call)
        if body.stream:
            await generation.start_stream(request)  # a refusal is a status, not a 200 stream of one error
            events = respond_stream(state, body, generation, *extra)
            return EventStreamResponse(openai_api.guarded_stream(events, generation), on_close=generation.aclose)
        return await generation.json_response(request, respond_json(state, body, generation, *extra))

    @app.post("/v1/chat/completions", openapi_extra=_schema_extra(openai_schema.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await openai_call(request, openai_schema.ChatCompletionRequest, openai_api.prepare_chat,
                                 openai_api.chat_response, openai_api.chat_stream)

    @app.post("/v1/completions", openapi_extra=_schema_extra(openai_schema.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await openai_call(request, openai_schema.CompletionRequest, openai_api.prepare_completion,
                                 openai_api.completion_response, openai_api.completion_stream)

    @app.post("/v1/messages", openapi_extra=_schema_extra(anthropic_schema.MessagesRequest))
    async def messages(request: Request) -> Response:
        body = await parse_body(request, anthropic_schema.MessagesRequest, state.body_parser)
        return await anthropic_api.handle(state, request, body, call_of(request))

    @app.post("/v1/moderations", openapi_extra=_schema_extra(ModerationRequest))
    async def moderations(request: Request) -> Response:
        body = await parse_body(request, ModerationRequest, state.body_parser)
        return JSONResponse(moderation_response(state.config.safety, body.texts()))

    @app.post("/v1/embeddings", openapi_extra=_schema_extra(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        return await create_embeddings(state, request, call_of(request))

    def model_card(name: str) -> dict:
        if name in state.embedding_model_names:
            return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenway",
                    "kind": "embeddings", "dimensions": state.embedder.dimensions,
                    "max_model_len": state.embedder.model.max_input_tokens}
        aliases = sorted(alias for alias, target in state.aliases.items() if target == name)
        card = {"id": name, "object": "model", "created": state.created, "owned_by": "tokenway", "kind": "chat",
                "max_model_len": state.max_model_len(name), "aliases": aliases}
        if state.gatekeeper is not None and name in state.gatekeeper.prices:
            card["pricing"] = state.gatekeeper.prices.price(name).to_dict()  # USD per million tokens
        return card

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        """The models the caller's key may use, as OpenAI lists those a key has access to."""
        principal = call_of(request).start.principal
        return {"object": "list", "data": [model_card(name)
                                           for name in state.model_names + state.embedding_model_names
                                           if principal.may_use(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> dict:
        principal = call_of(request).start.principal
        if model_id in state.embedding_model_names:
            return model_card(state.resolve_model(model_id, principal, kind="embeddings"))
        return model_card(state.resolve_model(model_id, principal))

    @app.post("/tokenize", openapi_extra=_schema_extra(openai_schema.TokenizeRequest))
    @app.post("/v1/tokenize", include_in_schema=False)  # under the SDKs' base URL: client.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, openai_schema.TokenizeRequest, state.body_parser)
        frontend = state.tokenizing_frontend(body.model, call_of(request).start.principal)
        tokens = await state.prepare(request, openai_api.tokenize, frontend, body, state.tool_parser(frontend))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": frontend.max_model_len}

    @app.post("/detokenize", openapi_extra=_schema_extra(openai_schema.DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, openai_schema.DetokenizeRequest, state.body_parser)
        frontend = state.tokenizing_frontend(body.model, call_of(request).start.principal)
        vocab_size = frontend.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise InvalidRequestError(f"tokens: token ids must be in [0, {vocab_size})", param="tokens")
        return {"prompt": frontend.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/engine/stats")
    async def engine_stats(request: Request) -> dict:
        """A snapshot of the engine: what runs, what waits, how full the KV cache is. Each pool's
        replicas (their names are hosts) for the admin, and for anyone while auth is off; an API
        key sees its models' pools as totals."""
        principal = call_of(request).start.principal
        stats = state.engine_stats()
        if principal is ADMIN or principal is ANONYMOUS:
            return stats
        visible = {pool.name for model, pool in state.router.pools.items() if principal.may_use(model)}
        return {**stats, "replicas": pool_totals(stats["replicas"], visible)}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        engine_alive = state.engine is None or state.engine.is_alive
        if state.ready and engine_alive and all(state.router.is_servable(n) for n in state.model_names):
            body: dict[str, Any] = {"status": "ready", "models": list(state.model_names)}
            if state.gatekeeper is not None:
                # A degraded ledger stays ready (200): its database is shared by every gateway, so
                # a 503 here would take them all out of rotation at once, while each can still
                # serve safely (rows journaled and replayed once it is back, budgets counting
                # them meanwhile). The body says so; alert on tokenway_ledger_degraded.
                body["ledger"] = "degraded" if state.gatekeeper.ledger.health().degraded else "ok"
            return JSONResponse(body)
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    if state.gatekeeper is not None:
        app.include_router(admin_router(state.gatekeeper.keys, state.config.admin_key))

        @app.get("/v1/usage")
        async def usage(request: Request, key_id: str | None = None, since: float | None = None,
                        until: float | None = None) -> dict:
            """The caller's usage by day and model; the admin key's: every key's, or the key_id named."""
            principal = call_of(request).start.principal
            if key_id is None:
                key_id = None if principal is ADMIN else principal.key_id
            elif key_id != principal.key_id and principal is not ADMIN:
                raise PermissionDeniedError("Only the admin key may read another key's usage.", param="key_id")
            try:
                rows = await state.gatekeeper.ledger.usage(key_id, since, until)
            except LedgerUnavailable as exc:
                raise ServiceUnavailableError("Usage cannot be read while the ledger's database is unreachable; "
                                              "calls are still recorded.", retry_after=exc.retry_after_s,
                                              code="ledger_unavailable") from exc
            return {"object": "list", "data": rows}

    if state.observer is not None:
        app.include_router(observability_router(state))
    app.add_middleware(GatewayMiddleware, max_body_bytes=state.config.max_body_bytes, gatekeeper=state.gatekeeper,
                       observer=state.observer, admin_key=state.config.admin_key)
    return app


def pool_totals(pool_to_replicas: dict[str, dict[str, dict]], shown: set[str]) -> dict[str, dict]:
    """Router.stats() without the replicas' names: per pool (of those `shown`), how many
    replicas, how many available, and their calls and tokens in flight."""
    return {pool: {"num_replicas": len(replicas),
                   "num_available": sum(r["available"] for r in replicas.values()),
                   "num_in_flight": sum(r["num_in_flight"] for r in replicas.values()),
                   "num_outstanding_tokens": sum(r["num_outstanding_tokens"] for r in replicas.values())}
            for pool, replicas in pool_to_replicas.items() if pool in shown}


def safety_headers(call: Call) -> dict[str, str]:
    """What the safety stage found, named (never the text): the input's, and the output's where
    the response starts after it is known (not a stream's)."""
    headers = {}
    screening, guard = call.screening, call.guard
    found = sorted({*(screening.categories if screening is not None else ()),
                    *(guard.categories if guard is not None else ())})
    if found:
        action = screening.action if screening is not None and screening.categories else "flag"
        headers["x-tokenway-safety-input"] = f"{action}; {','.join(found)}"
    outcome = call.outcome
    if outcome is not None and outcome.safety_output:
        headers["x-tokenway-safety-output"] = f"{outcome.safety_output_action}; {','.join(outcome.safety_output)}"
    return headers
