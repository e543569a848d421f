"""Anthropic's Message Batches API, on the same store and runner as OpenAI's Batch API:

    POST /v1/messages/batches                 requests [{custom_id, params}]: each a /v1/messages call
    GET  /v1/messages/batches                 the key's batches, newest first (after_id, limit)
    GET  /v1/messages/batches/{id}            the batch now: processing_status, request_counts
    POST /v1/messages/batches/{id}/cancel     canceling: requests not started are not run
    DELETE /v1/messages/batches/{id}          an ended batch, and its results
    GET  /v1/messages/batches/{id}/results    once ended: one JSONL line a request (tokenway/batches/lines.py)

Errors are Anthropic-shaped (every path here is under /v1/messages). Each request's params are
checked as a Messages request when it runs: a bad one is that request's errored result, as
Anthropic reports it; what is checked up front is what would make the batch unrunnable (a model
not served, a stream, a repeated custom_id). A batch belongs to the key that made it.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.batches import Batch, new_batch
from tokenway.batches.intake import read_message_batch
from tokenway.protocol.batches import (
    COMPLETION_WINDOW_S,
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchCreateRequest,
    MessageBatchList,
)
from tokenway.protocol.errors import FieldError, InvalidRequestError, NotFoundError, TokenwayError, truncate
from tokenway.server.batches_api import check_may_run
from tokenway.server.files_api import batch_store_of
from tokenway.server.http import read_body
from tokenway.server.responses_api import page_limit
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services

MESSAGE_BATCH_ID = re.compile(r"msgbatch_[A-Za-z0-9]{1,64}")


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages/batches", openapi_extra=schema_extra(MessageBatchCreateRequest))
    async def create(request: Request) -> Response:
        store = batch_store_of(services)
        # Read, checked and packed in the body parser's worker process (intake.py): the loop
        # never holds the requests as models, and the store writes them a chunk at a time.
        lines = await read_body(request, read_message_batch, services.body_parser)
        principal = call_of(request).start.principal
        check_may_run(services, principal)
        for model, index in lines.model_to_first_index.items():  # each model once, the earliest request naming it
            assert model is not None, "read_message_batch refuses a model that is not a string"
            where = f"requests[{index}].params.model"
            try:
                services.resolve_model(model, principal)
            except TokenwayError as exc:  # 404 not served, 403 not this key's: the same error, naming the request
                raise type(exc)(f"{where}: {exc.message}", param=where, code=exc.code) from None
        batch = new_batch("anthropic", principal.key_id, "/v1/messages", now=time.time(),
                          completion_window_s=COMPLETION_WINDOW_S)
        created = await store.create_batch(batch, lines)
        return JSONResponse(message_batch_json(created, request))

    @api.get("/v1/messages/batches")
    async def list_batches(request: Request) -> Response:
        store = batch_store_of(services)
        query = request.query_params
        if query.get("before_id") is not None:
            raise InvalidRequestError("before_id: this server pages forward only; use after_id", param="before_id")
        try:
            page = await store.list_batches(call_of(request).start.principal.key_id, api="anthropic",
                                            after=query.get("after_id"), limit=page_limit(query.get("limit")))
        except FieldError as exc:
            raise InvalidRequestError(str(exc).replace("after", "after_id", 1), param="after_id") from None
        listed: MessageBatchList = {"data": [message_batch_json(batch, request) for batch in page.data],
                                    "has_more": page.has_more, "first_id": page.first_id, "last_id": page.last_id}
        return JSONResponse(listed)

    @api.get("/v1/messages/batches/{batch_id}")
    async def retrieve(request: Request, batch_id: str) -> Response:
        return JSONResponse(message_batch_json(await stored_message_batch(services, request, batch_id), request))

    @api.post("/v1/messages/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> Response:
        store = batch_store_of(services)
        key_id = call_of(request).start.principal.key_id
        batch = await store.cancel_batch(batch_id, key_id) if MESSAGE_BATCH_ID.fullmatch(batch_id) else None
        if batch is None or batch.api != "anthropic":
            raise message_batch_not_found(batch_id)
        return JSONResponse(message_batch_json(batch, request))

    @api.delete("/v1/messages/batches/{batch_id}")
    async def delete(request: Request, batch_id: str) -> Response:
        store = batch_store_of(services)
        batch = await stored_message_batch(services, request, batch_id)
        # An ended batch only: one still running is a 400 (BatchNotEndedError): cancel it first.
        if not await store.delete_batch(batch.id, batch.key_id):
            raise message_batch_not_found(batch_id)
        deleted: DeletedMessageBatch = {"id": batch.id, "type": "message_batch_deleted"}
        return JSONResponse(deleted)

    @api.get("/v1/messages/batches/{batch_id}/results")
    async def results(request: Request, batch_id: str) -> Response:
        store = batch_store_of(services)
        batch = await stored_message_batch(services, request, batch_id)
        if batch.processing_status != "ended":
            raise InvalidRequestError(f"Message batch {batch_id} is still {batch.processing_status}; its results are "
                                      "available once processing has ended")
        # Every request's result line is in the batch's output file (finalize_ready writes it).
        content = b""
        if batch.output_file_id is not None:
            content = await store.file_content(batch.output_file_id, batch.key_id) or b""
        return Response(content, media_type="application/x-jsonl")

    return api


async def stored_message_batch(services: Services, request: Request, batch_id: str) -> Batch:
    batch = None
    if MESSAGE_BATCH_ID.fullmatch(batch_id):
        batch = await batch_store_of(services).get_batch(batch_id, call_of(request).start.principal.key_id)
    if batch is None or batch.api != "anthropic":
        raise message_batch_not_found(batch_id)
    return batch


def message_batch_not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"No message batch with id {truncate(batch_id)!r}", param="message_batch_id")


def rfc3339(unix_s: float | None) -> str | None:
    if unix_s is None:
        return None
    return datetime.fromtimestamp(unix_s, UTC).isoformat().replace("+00:00", "Z")


def message_batch_json(batch: Batch, request: Request) -> MessageBatch:
    counts = batch.counts
    ended = batch.processing_status == "ended"
    results_url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{batch.id}/results" if ended else None
    created_at, expires_at = rfc3339(batch.created_at), rfc3339(batch.expires_at)
    assert created_at is not None and expires_at is not None
    return {
        "id": batch.id, "type": "message_batch", "processing_status": batch.processing_status,
        "request_counts": {"processing": counts.pending, "succeeded": counts.succeeded, "errored": counts.failed,
                           "canceled": counts.cancelled, "expired": counts.expired},
        "created_at": created_at, "expires_at": expires_at, "ended_at": rfc3339(batch.ended_at),
        "cancel_initiated_at": rfc3339(batch.status_times.get("cancelling_at")), "archived_at": None,
        "results_url": results_url,
    }
