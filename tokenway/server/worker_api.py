"""The HTTP side of `tokenway worker`: one engine served to gateways on other hosts, in the
protocol routing/wire.py describes. A small app of its own, apart from the public one
(server/app.py): no API keys, limits, ledger or templates here; the gateway did all that and
sends token ids, and this app answers to whoever holds the shared secret.

    POST /worker/v1/generate ─► GenerateBody ─► SamplingParams, choice_params ─► n engine requests
        ─► their outputs merged as they come ─► one event per delta ─► usage ─► [DONE]

A caller that goes away closes the event stream, and closing it aborts every engine request
of the call within one engine step (_ClosingEventStream makes sure the stream is closed).
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast

import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenway.engine.client import EngineClient, EngineDeadError
from tokenway.frontend.output import RequestOutput
from tokenway.protocol.errors import (
    AuthenticationError,
    InternalServerError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    TokenwayError,
    UnsupportedMediaTypeError,
    from_validation_error,
    invalid_value,
    openai_error_body,
)
from tokenway.protocol.job import ServiceClass
from tokenway.protocol.sampling import SamplingParams, choice_params
from tokenway.routing import wire
from tokenway.routing.replicas import choice_delta, run_choices
from tokenway.server import sse
from tokenway.server.http import EventStreamResponse, is_json_media_type

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # a prompt of 1M token ids is ~7 MB of JSON


class _Aborted(Exception):
    """The engine aborted a request while its caller still listened: the worker is stopping."""


class _Load:
    """Engine requests (choices) of the calls this app has open; only the event loop touches it."""

    def __init__(self, max_pending_requests: int) -> None:
        self.max_pending_requests = max_pending_requests
        self.num_in_flight = 0

    def take(self, count: int) -> None:
        if self.num_in_flight + count > self.max_pending_requests:
            raise ServiceUnavailableError(f"The worker is at capacity ({self.num_in_flight} requests in flight).",
                                          retry_after=1)
        self.num_in_flight += count

    def release(self, count: int) -> None:
        self.num_in_flight -= count


def create_worker_app(engine: EngineClient, model_name: str, secret: str | None, *, model_dir: str | Path,
                      block_size: int, max_pending_requests: int = 256) -> Starlette:
    """secret None: no auth (only for a worker bound to loopback; worker_cli refuses the rest)."""
    load = _Load(max_pending_requests)
    # Encoded once: tokenizer.json is megabytes and never changes.
    tokenizer_body = json.dumps({"model": model_name, "files": read_tokenizer_files(Path(model_dir))},
                                ensure_ascii=False).encode()
    # Engine request ids get the call's number here: a gateway's request_id may come again (a
    # retry) while the engine still holds the aborted attempt, and the engine refuses a
    # request_id it holds. "{request_id}:{call number}", then "-{i}" per choice when n > 1.
    call_numbers = itertools.count()

    async def generate(request: Request) -> Response:
        body = await read_body(request)
        try:
            call = wire.GenerateBody.model_validate_json(body)
        except pydantic.ValidationError as exc:
            raise from_validation_error(exc) from None
        try:
            params = wire.params_from_wire(call.params)
            # The choices differ only in their seeds: one check covers them all.
            engine.validate_prompt(call.prompt_token_ids, params)
        except ValueError as exc:
            raise invalid_value(exc) from None
        except EngineDeadError:
            raise ServiceUnavailableError("The worker's engine is restarting; retry shortly.", retry_after=1,
                                          code="engine_unavailable") from None
        load.take(call.n)
        request_id = f"{call.request_id}:{next(call_numbers)}"
        return _ClosingEventStream(call_events(engine, request_id, call.prompt_token_ids,
                                               choice_params(params, call.n), call.service_class),
                                   on_close=lambda: load.release(call.n))

    async def state(request: Request) -> Response:
        stats = engine.stats()
        total, free = stats.kv_blocks_total, stats.kv_blocks_free
        return JSONResponse({
            "model": model_name, "ready": engine.is_alive, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size, "block_size": block_size, "num_in_flight": load.num_in_flight,
            "max_pending_requests": load.max_pending_requests,
            "kv_cache_usage": 1.0 - free / total if total else None,
            "engine": stats.to_dict(),  # EngineStats.from_dict on the gateway (WorkerReplica.state)
        })

    async def tokenizer(request: Request) -> Response:
        return Response(tokenizer_body, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if engine.is_alive:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"retry-after": "1"})

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):  # no such route or method
            body = {"error": {"message": exc.detail, "type": "invalid_request_error", "param": None, "code": None}}
            return JSONResponse(body, status_code=exc.status_code)
        if not isinstance(exc, TokenwayError):
            logger.exception("worker: %s %s failed", request.method, request.url.path, exc_info=exc)
            exc = InternalServerError()
        return JSONResponse(openai_error_body(exc), status_code=exc.status, headers=exc.headers)

    app = Starlette(routes=[
        Route(f"{wire.PREFIX}/generate", generate, methods=["POST"]),
        Route(f"{wire.PREFIX}/state", state),
        Route(f"{wire.PREFIX}/tokenizer", tokenizer),
        Route("/health", health),
        Route("/ready", ready),
    ], exception_handlers={HTTPException: on_error, TokenwayError: on_error, Exception: on_error})
    if secret is not None:
        app.add_middleware(SecretMiddleware, secret=secret)
    return app


class SecretMiddleware:
    """Every path under /worker/v1 (unknown ones too) needs `Authorization: Bearer <secret>`;
    refused before the body is read, so nothing of an unauthenticated call ever runs."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        if not secret:
            raise ValueError("secret: must not be empty")
        self.app = app
        self._secret = secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(wire.PREFIX + "/"):
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = supplied.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._secret):
                error = AuthenticationError("Missing or wrong worker secret (Authorization: Bearer <secret>).")
                response = JSONResponse(openai_error_body(error), status_code=401,
                                        headers={"www-authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


async def read_body(request: Request) -> bytes:
    if not is_json_media_type(request.headers.get("content-type")):
        raise UnsupportedMediaTypeError("Content-Type must be application/json.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"Request body is larger than {MAX_BODY_BYTES} bytes.")
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES:
            raise PayloadTooLargeError(f"Request body is larger than {MAX_BODY_BYTES} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def read_tokenizer_files(model_dir: Path) -> dict[str, str]:
    """The TOKENIZER_FILES the model directory has, as text (read once: they never change)."""
    files = {name: (model_dir / name).read_text(encoding="utf-8") for name in wire.TOKENIZER_FILES
             if (model_dir / name).is_file()}
    if "tokenizer.json" not in files:
        raise ValueError(f"{model_dir}: no tokenizer.json")
    return files


async def call_events(engine: EngineClient, request_id: str, prompt_token_ids: list[int],
                      params_list: list[SamplingParams], service_class: ServiceClass = "default",
                      ) -> AsyncIterator[bytes]:
    """The call's event stream: deltas, usage, [DONE]; or an error event where it failed."""
    num_completion_tokens = [0] * len(params_list)
    num_cached_tokens, cache_reason = 0, None
    try:
        choices = cast("AsyncGenerator[tuple[int, RequestOutput], None]",  # an async generator: aclose aborts
                       run_choices(engine, request_id, prompt_token_ids, params_list, service_class))
        async with aclosing(choices) as outputs:
            async for index, output in outputs:
                delta = choice_delta(index, output)  # as LocalReplica releases it
                if delta.finish_reason == "abort":
                    raise _Aborted()
                num_completion_tokens[index] += len(delta.token_ids)
                if delta.num_cached_tokens >= num_cached_tokens:
                    num_cached_tokens, cache_reason = delta.num_cached_tokens, delta.cache_reason
                yield sse.data_event({
                    "index": index, "text": delta.text, "token_ids": delta.token_ids,
                    "logprobs": wire.logprobs_to_wire(None if delta.logprobs is None else list(delta.logprobs)),
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason, "num_cached_tokens": delta.num_cached_tokens,
                    "cache_reason": delta.cache_reason,
                })
        yield sse.data_event({"usage": {"prompt_tokens": len(prompt_token_ids),
                                        "completion_tokens": sum(num_completion_tokens),
                                        "cached_tokens": num_cached_tokens, "cache_reason": cache_reason}})
        yield sse.DONE
    except Exception as exc:  # noqa: BLE001 - the engine logged its own traceback
        # The headers are sent: the failure goes in the stream. 503 while no token of the call
        # exists, so the gateway may still run it elsewhere; 500 once the caller may have text.
        status = 500 if any(num_completion_tokens) else 503
        stopped = isinstance(exc, (EngineDeadError, _Aborted))
        logger.warning("worker: request %s failed: %s", request_id, type(exc).__name__)
        yield error_event(status, f"The worker's engine {'stopped' if stopped else 'failed'} while generating "
                                  "this request.")


def error_event(status: int, message: str) -> bytes:
    kind = "service_unavailable" if status == 503 else "internal_error"
    return sse.data_event({"error": {"message": message, "type": kind, "code": status}})


class _ClosingEventStream(EventStreamResponse):
    """Starlette leaves a body iterator that stopped at a yield (the caller went away while a
    write was pending) open until garbage collection; this closes it at once, so its engine
    requests are aborted now, and then calls on_close (also for a stream that never started,
    whose generator would run no finally of its own)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self._events: Any = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()
