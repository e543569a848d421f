"""OpenAI's Batch API over the batch store (tokenway/batches/):

    POST /v1/batches                 a batch of an uploaded file's requests (files_api.py), one
                                     endpoint, completion_window "24h": in_progress, or failed
                                     with errors naming its bad lines
    GET  /v1/batches/{id}            the batch now: status, request_counts, its output files' ids
    GET  /v1/batches                 the key's batches, newest first (after, limit)
    POST /v1/batches/{id}/cancel     cancelling: lines not started are not run; then cancelled

The lines run on the BatchRunner (cli.py starts it), each through the endpoint's own HTTP path
(batch_lines.py). A batch belongs to the key that made it: another key's is a 404.
"""

from __future__ import annotations

import re
import time

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.batches import Batch, new_batch
from tokenway.batches.intake import read_batch_file_lines
from tokenway.gateway.auth import ADMIN, Principal
from tokenway.gateway.tiers import TierAsk
from tokenway.protocol.batches import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOW_S,
    BadLine,
    BatchCreateRequest,
    BatchError,
    BatchList,
)
from tokenway.protocol.batches import Batch as BatchBody
from tokenway.protocol.errors import FieldError, InvalidRequestError, NotFoundError, PermissionDeniedError, truncate
from tokenway.server.files_api import FILE_ID, batch_store_of, chunks_of, model_checker
from tokenway.server.http import parse_body
from tokenway.server.responses_api import key_of, page_limit
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services

BATCH_ID = re.compile(r"batch_[A-Za-z0-9]{1,64}")
BATCH_ASK = TierAsk(("batch",), "batch")


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/batches", openapi_extra=schema_extra(BatchCreateRequest))
    async def create(request: Request) -> Response:
        store = batch_store_of(services)
        body = await parse_body(request, BatchCreateRequest, services.body_parser)
        principal = call_of(request).start.principal
        check_may_run(services, principal)
        if body.endpoint not in BATCH_ENDPOINTS:
            raise InvalidRequestError(f"endpoint: this server runs batches of {', '.join(BATCH_ENDPOINTS)}; got "
                                      f"{truncate(body.endpoint)!r}", param="endpoint")
        file_id = body.input_file_id
        file = await store.get_file(file_id, principal.key_id) if FILE_ID.fullmatch(file_id) else None
        content = await store.file_content(file_id, principal.key_id) if file is not None else None
        if file is None or content is None:
            raise NotFoundError(f"input_file_id: no such File object: {truncate(file_id)}", param="input_file_id")
        if file.purpose != "batch":
            raise InvalidRequestError(f"input_file_id: file {file_id} has purpose '{file.purpose}'; a batch's "
                                      "input is a file uploaded with purpose 'batch'", param="input_file_id")
        # Checked again: what the key may run, or the server serves, may have changed since the
        # upload. Read and packed in the body parser's worker process (intake.py), off the loop.
        reading, _ = await services.body_parser.parse_with(chunks_of(content), read_batch_file_lines)
        del content
        bad = reading.problems(model_checker(services, principal), body.endpoint)
        errors = [batch_error(line) for line in bad]
        batch = new_batch("openai", principal.key_id, body.endpoint, now=time.time(), input_file_id=file_id,
                          metadata=body.metadata, completion_window_s=COMPLETION_WINDOW_S, errors=errors)
        # A failed batch keeps no lines: none of them runs.
        assert reading.lines is not None, "read_batch_file_lines packs the lines"
        created = await store.create_batch(batch, [] if bad else reading.lines)
        return JSONResponse(batch_json(created))

    @api.get("/v1/batches/{batch_id}")
    async def retrieve(request: Request, batch_id: str) -> Response:
        return JSONResponse(batch_json(await stored_batch(services, request, batch_id)))

    @api.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        store = batch_store_of(services)
        query = request.query_params
        try:
            page = await store.list_batches(key_of(request), api="openai", after=query.get("after"),
                                            limit=page_limit(query.get("limit")))
        except FieldError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        listed: BatchList = {"object": "list", "data": [batch_json(batch) for batch in page.data],
                             "first_id": page.first_id, "last_id": page.last_id, "has_more": page.has_more}
        return JSONResponse(listed)

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> Response:
        store = batch_store_of(services)
        batch = await store.cancel_batch(batch_id, key_of(request)) if BATCH_ID.fullmatch(batch_id) else None
        if batch is None:
            raise batch_not_found(batch_id)
        return JSONResponse(batch_json(batch))

    return api


def check_may_run(services: Services, principal: Principal) -> None:
    """A batch is refused at once where none of its lines could run: the admin key's, or a key
    without the batch tier (403 service_tier_not_allowed, as each line would be)."""
    if principal.key_id == ADMIN.key_id:
        raise PermissionDeniedError("The admin key manages this server; it runs no batch. Make batches with an API "
                                    "key (POST /admin/keys or `tokenway keys create`).", code="admin_key_not_for_calls")
    if services.gatekeeper is not None:
        services.gatekeeper.service_class(principal, BATCH_ASK, batch_line="")


async def stored_batch(services: Services, request: Request, batch_id: str) -> Batch:
    batch = None
    if BATCH_ID.fullmatch(batch_id):
        batch = await batch_store_of(services).get_batch(batch_id, key_of(request))
    if batch is None or batch.api != "openai":
        raise batch_not_found(batch_id)
    return batch


def batch_not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"No such Batch object: {truncate(batch_id)}", param="batch_id")


def batch_error(line: BadLine) -> BatchError:
    return {"code": "invalid_request", "message": line.problem, "param": None, "line": line.number}


def batch_json(batch: Batch) -> BatchBody:
    """OpenAI's Batch. request_counts: completed, the lines answered 200; failed, those answered
    an error or expired; lines cancelled before they ran count in total only, as OpenAI counts them."""
    times, counts = batch.status_times, batch.counts

    def at(name: str) -> int | None:
        return int(times[name]) if name in times else None

    window_h = round(batch.completion_window_s / 3600)
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": [BatchError(
            code=error.get("code"), message=error.get("message"), param=error.get("param"),
            line=error.get("line")) for error in batch.errors]} if batch.errors else None,
        "input_file_id": batch.input_file_id or "", "completion_window": f"{window_h}h", "status": batch.status,
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at), "in_progress_at": at("in_progress_at"),
        "expires_at": int(batch.expires_at), "finalizing_at": at("finalizing_at"), "completed_at": at("completed_at"),
        "failed_at": at("failed_at"), "expired_at": at("expired_at"), "cancelling_at": at("cancelling_at"),
        "cancelled_at": at("cancelled_at"),
        "request_counts": {"total": counts.total, "completed": counts.succeeded,
                           "failed": counts.failed + counts.expired},
        "metadata": dict(batch.metadata) if batch.metadata is not None else None, "model": batch.model,
    }
