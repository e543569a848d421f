"""The ASGI app, assembled from one router per API, the error boundary and the gateway
middleware (gateway_middleware.py: the body-size limit, auth, the stage clock, the ledger row).

    openai_api       /v1/chat/completions, /v1/completions
    responses_api    /v1/responses (and a stored response's routes), /v1/responses/input_tokens
    anthropic_api    /v1/messages
    moderations_api  /v1/moderations
    embeddings_api   /v1/embeddings
    files_api        /v1/files (the Batch API's input and output files)
    batches_api      /v1/batches                 (OpenAI's Batch API)
    message_batches_api /v1/messages/batches     (Anthropic's Message Batches)
    models_api       /v1/models, /tokenize, /detokenize
    ops_api          /engine/stats, /health, /ready
    admin_api        /admin/keys, /v1/usage                       (with a gatekeeper)
    observability_api /metrics, /v1/traces, /dashboard, ...       (with an observer)

A POST on a generation route (GENERATION_PATHS) goes from the middleware straight to the
endpoint its router registered (direct_routes.py), below FastAPI's routing; the handlers below
answer its errors as they answer every other route's.

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

from tokenway.protocol.anthropic import MessagesPrompt, MessagesRequest
from tokenway.protocol.batches import BatchCreateRequest, MessageBatchCreateRequest
from tokenway.protocol.embeddings import EmbeddingRequest
from tokenway.protocol.errors import (
    InternalServerError,
    InvalidRequestError,
    NotFoundError,
    TokenwayError,
    from_validation_error,
)
from tokenway.protocol.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenway.protocol.responses import InputTokensRequest, ResponsesRequest
from tokenway.server import (
    admin_api,
    anthropic_api,
    batches_api,
    embeddings_api,
    files_api,
    message_batches_api,
    models_api,
    moderations_api,
    observability_api,
    openai_api,
    ops_api,
    responses_api,
)
from tokenway.server.direct_routes import DirectRoutes
from tokenway.server.gateway_middleware import GENERATION_PATHS, GatewayMiddleware, error_response
from tokenway.server.http import ClientDisconnected
from tokenway.server.routes import call_of
from tokenway.server.services import Services

logger = logging.getLogger(__name__)

# The request bodies the API routes parse themselves, in the OpenAPI document's components.
REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, InputTokensRequest, MessagesRequest,
                  MessagesPrompt, EmbeddingRequest, TokenizeRequest, DetokenizeRequest, BatchCreateRequest,
                  MessageBatchCreateRequest)
# In the order their routes appear in the OpenAPI document.
ROUTERS = (openai_api, responses_api, anthropic_api, moderations_api, embeddings_api, files_api, batches_api,
           message_batches_api, models_api, ops_api, admin_api, observability_api)
# A multipart upload's framing (boundaries, part headers) beyond the file's own bytes.
MULTIPART_SLACK_BYTES = 64 * 1024


def create_app(services: Services, *, direct_routes: bool = True) -> FastAPI:
    """direct_routes: a POST on a generation route goes from GatewayMiddleware straight to its
    endpoint (server/direct_routes.py); False: through FastAPI's routing like every other request."""
    # tokenway traces and counts every call itself (observability/); FastAPI's own telemetry would
    # ask OpenTelemetry for its providers on every request, and span each one twice where one is set.
    app = FastAPI(title="tokenway", version="0.1.0", description="OpenAI- and Anthropic-compatible LLM API",
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.services = services
    routers = [module.router(services) for module in ROUTERS]
    for router in routers:
        app.include_router(router)
    add_error_handlers(app)
    schema_with_request_models(app)
    settings = services.settings
    app.add_middleware(GatewayMiddleware, max_body_bytes=settings.max_body_bytes, gatekeeper=services.gatekeeper,
                       observer=services.observer, admin_key=settings.admin_key,
                       max_upload_bytes=settings.max_batch_file_bytes + MULTIPART_SLACK_BYTES,
                       direct_routes=DirectRoutes.of(app, routers, GENERATION_PATHS) if direct_routes else None)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TokenwayError)
    async def on_tokenway_error(request: Request, exc: TokenwayError) -> JSONResponse:
        call_of(request).end_with_error(exc.status, exc.message, getattr(exc, "limit_kind", None))
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, from_validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            return error_response(path, NotFoundError(f"No route {request.method} {path}"))
        message = f"Method {request.method} is not allowed on {path}" if exc.status_code == 405 else str(exc.detail)
        return error_response(path, InvalidRequestError(message), status=exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def on_client_gone(request: Request, exc: ClientDisconnected) -> Response:
        call_of(request).end_with_error(499, "client disconnected")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, InternalServerError("The server had an error processing the request"))


def schema_with_request_models(app: FastAPI) -> None:
    """The OpenAPI document with the request bodies the routes parse themselves (schema_extra)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in REQUEST_MODELS:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize it
