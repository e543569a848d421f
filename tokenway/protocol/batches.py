"""The Files and Batch APIs' bodies, OpenAI's and Anthropic's, field for field as the official
SDKs name them (openai/types/file_object.py, batch.py; anthropic/types/messages/message_batch*.py).

    POST /v1/files (multipart JSONL) ──► check_batch_file ──► BatchFileLine, one per line
    POST /v1/batches ──► BatchCreateRequest          POST /v1/messages/batches ──► MessageBatchCreateRequest
    tokenway/batches/ (store, runner) ──► server/*batches_api.py ──► FileObject | Batch | MessageBatch
    (a done line's output, error and results lines: tokenway/batches/lines.py)

A batch input file is checked whole before it is kept: each line a JSON object with a unique
custom_id, method POST, a url the Batch API runs and a body object whose model is served; a
bad line is a 400 naming its line number (1-based, as an editor shows it). What the body holds
beyond its model is the endpoint's own business: a body its endpoint refuses becomes that
line's error in the error file, as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator

# pydantic reads only typing_extensions' TypedDict before Python 3.12.
from typing_extensions import TypedDict

from tokenway.protocol.errors import InvalidRequestError, short_repr
from tokenway.protocol.openai_messages import RequestModel, WireModel
from tokenway.protocol.responses import check_metadata

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
BATCH_ENDPOINTS: tuple[BatchEndpoint, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                              "/v1/responses")
MAX_BATCH_LINES = 50_000  # OpenAI's cap on one input file's requests
MAX_MESSAGE_BATCH_REQUESTS = 100_000  # Anthropic's on one message batch
MAX_CUSTOM_ID_CHARS = 512
MAX_LISTED_BAD_LINES = 10  # a 400 names this many bad lines, and counts the rest
COMPLETION_WINDOW_S = 24 * 3600
# Anthropic's custom_id: 1 to 64 of these.
MessageCustomId = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


# ---- requests -----------------------------------------------------------------------------------


class OutputExpiresAfter(WireModel):
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=30 * 24 * 3600)]


class BatchCreateRequest(RequestModel):
    """POST /v1/batches."""

    input_file_id: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    endpoint: str  # checked against BATCH_ENDPOINTS by the route, which names the ones it runs
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)


class MessageBatchRequest(WireModel):
    custom_id: MessageCustomId
    params: dict[str, Any]  # a Messages request; checked as one when its line runs


class MessageBatchCreateRequest(RequestModel):
    """POST /v1/messages/batches."""

    requests: Annotated[list[MessageBatchRequest], Field(min_length=1, max_length=MAX_MESSAGE_BATCH_REQUESTS)]


# ---- an input file's lines ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchFileLine:
    number: int  # 1-based, in the file
    custom_id: str
    url: BatchEndpoint
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BadLine:
    number: int
    problem: str


def bad_lines_error(bad: list[BadLine]) -> InvalidRequestError:
    """One 400 naming the first bad lines, and how many more there are."""
    listed = "; ".join(f"line {line.number}: {line.problem}" for line in bad[:MAX_LISTED_BAD_LINES])
    more = f"; and {len(bad) - MAX_LISTED_BAD_LINES} more" if len(bad) > MAX_LISTED_BAD_LINES else ""
    return InvalidRequestError(f"file: {len(bad)} bad line{'s' if len(bad) > 1 else ''}: {listed}{more}",
                               param="file", code="invalid_batch_line")


def check_batch_file(content: bytes, model_error: Callable[[str, str], str | None]) -> list[BatchFileLine]:
    """The lines of a batch input file (OpenAI's JSONL), or a 400 naming every bad line's number
    and what is wrong with it (bad_lines_error)."""
    lines, bad = read_batch_file(content, model_error)
    if bad:
        raise bad_lines_error(bad)
    return lines


def read_batch_file(content: bytes, model_error: Callable[[str, str], str | None]
                    ) -> tuple[list[BatchFileLine], list[BadLine]]:
    """The good lines of a batch input file (OpenAI's JSONL) and the bad ones, each with what is
    wrong with it. model_error(url, model): why that endpoint cannot run that model here (None:
    it can). Blank lines are skipped, as OpenAI skips them; a file that is not UTF-8, holds no
    request or too many is a 400."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"file: is not UTF-8 text (byte {exc.start})", param="file",
                                  code="invalid_file") from None
    lines: list[BatchFileLine] = []
    bad: list[BadLine] = []
    custom_id_to_number: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) + len(bad) >= MAX_BATCH_LINES:
            raise InvalidRequestError(f"file: holds more than {MAX_BATCH_LINES} requests", param="file",
                                      code="too_many_requests")
        line, problem = _check_line(number, raw, model_error)
        if line is not None and line.custom_id in custom_id_to_number:
            line, problem = None, (f"custom_id {short_repr(line.custom_id)} is that of line "
                                   f"{custom_id_to_number[line.custom_id]}; each must be unique")
        if line is None:
            bad.append(BadLine(number, problem))
            continue
        custom_id_to_number[line.custom_id] = number
        lines.append(line)
    if not lines and not bad:
        raise InvalidRequestError("file: holds no requests", param="file", code="empty_file")
    return lines, bad


def _check_line(number: int, raw: str, model_error: Callable[[str, str], str | None]
                ) -> tuple[BatchFileLine | None, str]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "is not JSON"
    if not isinstance(data, dict):
        return None, "is not a JSON object"
    custom_id, method, url, body = (data.get(name) for name in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return None, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters"
    if method != "POST":
        return None, f"method must be 'POST', got {short_repr(method)}"
    if url not in BATCH_ENDPOINTS:
        return None, f"url must be one of {', '.join(BATCH_ENDPOINTS)}, got {short_repr(url)}"
    if not isinstance(body, dict):
        return None, "body must be a JSON object"
    model = body.get("model")
    if not isinstance(model, str):
        return None, "body.model must be a string"
    if body.get("stream") is True:
        return None, "body.stream: a batch's requests are answered whole; remove stream"
    if url == "/v1/responses" and body.get("background") is True:
        return None, "body.background: a batch's requests run in the background already; remove background"
    error = model_error(url, model)
    if error is not None:
        return None, f"body.model: {error}"
    return BatchFileLine(number, custom_id, url, body), ""


# ---- OpenAI: what the routes send back ----------------------------------------------------------

FilePurpose = Literal["batch", "batch_output"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]


class FileObject(TypedDict):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: FilePurpose
    status: Literal["processed"]  # deprecated by OpenAI; always sent, a file is whole once kept
    status_details: None


class FileList(TypedDict):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(TypedDict):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchRequestCounts(TypedDict):
    total: int
    completed: int
    failed: int


class BatchError(TypedDict):
    code: str | None
    message: str | None
    param: str | None
    line: int | None


class BatchErrors(TypedDict):
    object: Literal["list"]
    data: list[BatchError]


class Batch(TypedDict):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None
    model: str | None


class BatchList(TypedDict):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---- Anthropic ----------------------------------------------------------------------------------


class MessageBatchRequestCounts(TypedDict):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(TypedDict):
    id: str
    type: Literal["message_batch"]
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    created_at: str  # RFC 3339
    expires_at: str
    ended_at: str | None
    cancel_initiated_at: str | None
    archived_at: str | None
    results_url: str | None  # once ended


class MessageBatchList(TypedDict):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(TypedDict):
    id: str
    type: Literal["message_batch_deleted"]
