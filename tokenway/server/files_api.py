"""OpenAI's Files API, for the Batch API's files:

    POST   /v1/files                 upload (multipart: file, purpose "batch"): a JSONL of requests,
                                     checked line by line (protocol/batches.py) before it is kept
    GET    /v1/files                 the key's files, a page at a time (purpose, after, limit, order)
    GET    /v1/files/{id}            one file
    DELETE /v1/files/{id}            deleted (the batches made from it run on)
    GET    /v1/files/{id}/content    its bytes: an input file, or a batch's output or error file

Files live in the batch store (tokenway/batches/) and belong to the key that made them (a
batch's output files to the batch's key): another key's is a 404, as one that does not exist.
"""

from __future__ import annotations

import re
import time
import unicodedata
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.batches import BatchStore, StoredFile, new_file_id
from tokenway.batches.intake import check_batch_file_lines
from tokenway.gateway.auth import Principal
from tokenway.protocol.batches import FileDeleted, FileList, FileObject, bad_lines_error
from tokenway.protocol.errors import (
    FieldError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    TokenwayError,
    UnsupportedMediaTypeError,
    short_repr,
    truncate,
)
from tokenway.server.responses_api import key_of, page_limit, page_order
from tokenway.server.routes import call_of
from tokenway.server.services import Services

FILE_ID = re.compile(r"file-[A-Za-z0-9]{1,64}")
BATCH_FILE_TTL_S = 30 * 24 * 3600  # OpenAI's default for purpose "batch"
MAX_FILENAME_CHARS = 255
MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 30 * 24 * 3600
CHUNK_BYTES = 1 << 20


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/files")
    async def upload(request: Request) -> Response:
        store = batch_store_of(services)
        content_type = request.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            raise UnsupportedMediaTypeError(f"Content-Type must be multipart/form-data, got "
                                            f"{truncate(content_type)!r}")
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise InvalidRequestError(f"purpose: this server keeps files for the Batch API only: send 'batch', "
                                          f"got {short_repr(purpose)}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidRequestError("file: missing; send the JSONL as the multipart field 'file'",
                                          param="file")
            ttl_s = expires_after_s(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
            filename = checked_filename(upload.filename)
            content = await upload.read()
        max_bytes = services.settings.max_batch_file_bytes
        if len(content) > max_bytes:
            raise PayloadTooLargeError(f"file: {len(content)} bytes exceed this server's limit of {max_bytes}")
        principal = call_of(request).start.principal
        # Every line read in the body parser's worker process (intake.py), off the loop; each
        # model the lines name asked about here, once.
        reading, _ = await services.body_parser.parse_with(chunks_of(content), check_batch_file_lines)
        if bad := reading.problems(model_checker(services, principal)):
            raise bad_lines_error(bad)
        now = time.time()
        stored = StoredFile(new_file_id(), principal.key_id, "batch", filename, len(content), now, now + ttl_s)
        await store.create_file(stored, content)
        return JSONResponse(file_json(stored))

    @api.get("/v1/files")
    async def list_files(request: Request) -> Response:
        store = batch_store_of(services)
        query = request.query_params
        purpose, order = query.get("purpose"), page_order(query.get("order"))
        if purpose not in (None, "batch", "batch_output"):
            raise InvalidRequestError(f"purpose: this server keeps 'batch' and 'batch_output' files, got "
                                      f"{short_repr(purpose)}", param="purpose")
        try:
            page = await store.list_files(key_of(request), purpose=purpose, after=query.get("after"),
                                          limit=page_limit(query.get("limit")), order=order)
        except FieldError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        listed: FileList = {"object": "list", "data": [file_json(file) for file in page.data],
                            "first_id": page.first_id, "last_id": page.last_id, "has_more": page.has_more}
        return JSONResponse(listed)

    @api.get("/v1/files/{file_id}")
    async def retrieve(request: Request, file_id: str) -> Response:
        return JSONResponse(file_json(await stored_file(services, request, file_id)))

    @api.delete("/v1/files/{file_id}")
    async def delete(request: Request, file_id: str) -> Response:
        store = batch_store_of(services)
        if not FILE_ID.fullmatch(file_id) or not await store.delete_file(file_id, key_of(request)):
            raise file_not_found(file_id)
        deleted: FileDeleted = {"id": file_id, "object": "file", "deleted": True}
        return JSONResponse(deleted)

    @api.get("/v1/files/{file_id}/content")
    async def content(request: Request, file_id: str) -> Response:
        store = batch_store_of(services)
        data = await store.file_content(file_id, key_of(request)) if FILE_ID.fullmatch(file_id) else None
        if data is None:
            raise file_not_found(file_id)
        return Response(data, media_type="application/octet-stream")

    return api


async def chunks_of(content: bytes) -> AsyncIterator[bytes]:
    """A file's bytes for BodyParser.parse_with, as a body arrives, CHUNK_BYTES at a time: views, not copies."""
    view = memoryview(content)
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start:start + CHUNK_BYTES]  # type: ignore[misc]  # bytes-like: the worker's pipe takes a view


def batch_store_of(services: Services) -> BatchStore:
    store = services.batch_store
    if store is None:
        raise NotFoundError("This server runs no Batch API (it keeps no files or batches).", code="batches_disabled")
    return store


async def stored_file(services: Services, request: Request, file_id: str) -> StoredFile:
    file = None
    if FILE_ID.fullmatch(file_id):
        file = await batch_store_of(services).get_file(file_id, key_of(request))
    if file is None:
        raise file_not_found(file_id)
    return file


def model_checker(services: Services, principal: Principal) -> Callable[[str, str], str | None]:
    """Why a batch line's endpoint cannot run its model for this key (None: it can)."""

    def model_error(url: str, model: str) -> str | None:
        try:
            services.resolve_model(model, principal, "embeddings" if url == "/v1/embeddings" else "chat")
        except TokenwayError as exc:
            return exc.message
        return None

    return model_error


def file_not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {truncate(file_id)}", param="id")


def checked_filename(filename: str | None) -> str:
    """The upload's filename as kept and echoed (its first MAX_FILENAME_CHARS), or a 400 naming
    the field for a control character in it (a NUL, an escape, C1): a name that would end a C
    string or rewrite a terminal where a listing is shown."""
    if not filename:
        return "batch.jsonl"
    for position, char in enumerate(filename):
        if unicodedata.category(char) == "Cc":
            raise InvalidRequestError(f"file: its filename holds the control character U+{ord(char):04X} at "
                                      f"position {position}; send a filename without control characters",
                                      param="file")
    return filename[:MAX_FILENAME_CHARS]


def expires_after_s(anchor: object, seconds: object) -> float:
    """The file's life from an upload's expires_after (OpenAI's form fields); 30 days without one."""
    if anchor is None and seconds is None:
        return BATCH_FILE_TTL_S
    if anchor != "created_at":
        raise InvalidRequestError(f"expires_after.anchor: must be 'created_at', got {short_repr(anchor)}",
                                  param="expires_after.anchor")
    if not isinstance(seconds, str) or not seconds.isascii() or not seconds.isdigit() \
            or not MIN_EXPIRES_AFTER_S <= int(seconds) <= MAX_EXPIRES_AFTER_S:
        raise InvalidRequestError(f"expires_after.seconds: must be an integer from {MIN_EXPIRES_AFTER_S} to "
                                  f"{MAX_EXPIRES_AFTER_S}, got {short_repr(seconds)}", param="expires_after.seconds")
    return int(seconds)


def file_json(file: StoredFile) -> FileObject:
    return {"id": file.id, "object": "file", "bytes": file.bytes, "created_at": int(file.created_at),
            "expires_at": int(file.expires_at) if file.expires_at is not None else None, "filename": file.filename,
            "purpose": file.purpose, "status": "processed", "status_details": None}

