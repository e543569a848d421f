"""What the Batch APIs keep (StoredFile, Batch and its lines) and the store they keep it in
(BatchStore, opened by open_batch_store): the ledger's database, so every gateway sharing it
serves the same files and runs the same queue.

    POST /v1/files ─► create_file(StoredFile, content)            (purpose "batch": validated JSONL)
    POST /v1/batches, /v1/messages/batches ─► create_batch(new_batch(...), lines) ─► in_progress
    BatchRunner (runner.py), on every gateway:
        claim(worker_id, n, lease_s, now) ─► BatchLine ... ─► execute ─► finish(worker_id, line, LineOutcome)
        renew(worker_id, lines, lease_until) while they run; a claim not renewed lapses, and
        any runner claims the line again (its worker died)
        finalize_ready(now): every line done ─► output and error files ─► completed | cancelled | expired
        expire(now): past expires_at ─► the lines not started ─► expired
    POST .../cancel ─► cancel_batch ─► cancelling: the lines not started ─► cancelled; those running finish
    GET ... ─► get_batch, list_batches, get_file, file_content, results (Anthropic's results)

The statuses (OpenAI's names; Anthropic's processing_status is derived from them):

    in_progress ─► finalizing ─► completed          every line done
        │  └──► cancelling ─► (finalizing) ─► cancelled
        └─────► expired                             past expires_at: lines not run are expired
    failed: the input was refused (errors name its lines); made so, never run

A batch's input is validated before create_batch (the API does it as the file is uploaded), so
a batch is made in_progress (or failed) and "validating" is never stored. finalizing lasts the
transaction that writes the files, so a reader sees it only in finalizing_at.

Every read is scoped to the key that made the file or batch: another key's is a miss, exactly
as one that never existed. A line's outcome is written once: by the worker that holds its claim,
or by cancel or expiry for a line no worker holds.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, get_args

from tokenway.protocol.errors import InvalidRequestError, ServiceUnavailableError

if TYPE_CHECKING:
    from tokenway.batches.packed import PackedLines

# A JSON object as decoded (a dict at run time); read-only to the store's callers.
JSONObject = Mapping[str, Any]

BatchApi = Literal["openai", "anthropic"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
Outcome = Literal["succeeded", "failed", "cancelled", "expired"]
FilePurpose = Literal["batch", "batch_output"]
ProcessingStatus = Literal["in_progress", "canceling", "ended"]  # Anthropic's

BATCH_STATUSES: tuple[BatchStatus, ...] = get_args(BatchStatus)
FINAL_STATUSES: frozenset[BatchStatus] = frozenset({"failed", "completed", "expired", "cancelled"})
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
FILE_PURPOSES: tuple[FilePurpose, ...] = get_args(FilePurpose)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")
# The timestamps of a batch's statuses beside created_at and expires_at, as Batch.status_times
# keys them (OpenAI's field names).
STATUS_TIME_FIELDS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                      "cancelled_at")
ID_PREFIXES: Mapping[BatchApi, str] = {"openai": "batch_", "anthropic": "msgbatch_"}
FILE_ID_PREFIX = "file-"
LINE_REQUEST_PREFIX = "batch_req_"  # OpenAI's output line ids: this + the line's line_id
ID_CHARS = 24
_BASE62 = string.digits + string.ascii_letters

DEFAULT_COMPLETION_WINDOW_S = 24 * 3600.0
# Runs of one line whose runner died each time (its claim lapsed): past this, the line fails
# rather than take down the next runner too.
MAX_ATTEMPTS = 3
MAX_PAGE_ITEMS = 100  # OpenAI's bound on a list's limit
DEFAULT_NUM_CONNECTIONS = 4


def _random_base62() -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(ID_CHARS))


def new_file_id() -> str:
    return FILE_ID_PREFIX + _random_base62()


def new_batch_id(api: BatchApi) -> str:
    return ID_PREFIXES[api] + _random_base62()


def line_id_of(batch_id: str, index: int) -> str:
    """The line's own id: alphanumeric and the same every time the line runs, so the call that
    runs it (CallStart.batch_line) makes the same job id, hence one ledger row however often a
    crash makes it run again."""
    return f"{batch_id.split('_', 1)[1]}l{index}"


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file's metadata; its content is read apart (file_content): it may be large."""

    id: str
    key_id: str  # the owner; "" when the gateway is off
    purpose: FilePurpose
    filename: str
    bytes: int
    created_at: float  # unix time
    expires_at: float | None

    def __post_init__(self) -> None:
        if not self.id.startswith(FILE_ID_PREFIX):
            raise ValueError(f"a file id starts with {FILE_ID_PREFIX!r}, got {self.id!r}")
        if self.purpose not in FILE_PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {self.purpose!r}")
        if self.bytes < 0:
            raise ValueError(f"bytes must be >= 0, got {self.bytes}")


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch, as a runner claims it: what to run, as whom, where."""

    batch_id: str
    index: int  # 0-based, in the input's order
    custom_id: str
    body: JSONObject  # the request body, as the endpoint takes it
    endpoint: str
    key_id: str
    api: BatchApi
    line_id: str  # line_id_of(batch_id, index): becomes CallStart.batch_line

    @property
    def request_id(self) -> str:
        """OpenAI's output line id."""
        return LINE_REQUEST_PREFIX + self.line_id


@dataclass(frozen=True, slots=True)
class LineOutcome:
    """What a line ended as. succeeded/failed: the API answered `status_code` with `response`,
    its body (an error body when it failed), or a failure before any answer has response None and
    `error` {"code", "message"}. cancelled/expired: never run (status_code and response None),
    `error` says why. request_id: the answer's x-request-id, where there was one. retry_after:
    for a refusal the line may outlive (429: limits or budget; 503: no capacity now), the seconds
    the answer asked to wait: the runner defers the line then instead of finishing it."""

    outcome: Outcome
    status_code: int | None
    response: JSONObject | None
    error: JSONObject | None
    request_id: str | None = None
    retry_after: float | None = None

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {self.outcome!r}")
        if self.outcome == "succeeded" and (self.status_code is None or self.status_code >= 400
                                            or self.response is None):
            raise ValueError("a succeeded line has a status_code below 400 and a response")
        if self.outcome == "failed" and self.response is None and self.error is None:
            raise ValueError("a failed line has the error body it was answered, or an error")


@dataclass(frozen=True, slots=True)
class BatchCounts:
    total: int
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    pending: int = 0  # not done yet: waiting or running


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    key_id: str
    api: BatchApi
    endpoint: str
    input_file_id: str | None  # None for Anthropic's (its requests come in the call's body)
    status: BatchStatus
    created_at: float
    expires_at: float
    status_times: Mapping[str, float]  # STATUS_TIME_FIELDS: those the batch has reached
    metadata: Mapping[str, str] | None
    errors: tuple[JSONObject, ...]  # a failed batch's: OpenAI's BatchError {"code", "line", "message", "param"}
    output_file_id: str | None
    error_file_id: str | None
    counts: BatchCounts
    model: str | None  # the first line's body's "model"
    # A batch handed whole to an upstream's own Batch API (server/batch_forward.py): the replica
    # ("model/replica": its pool and name) and, once submitted there, the upstream's batch id.
    # Its lines are never claimed; the forwarder writes their outcomes from the upstream's results.
    upstream: str | None = None
    upstream_batch_id: str | None = None

    def __post_init__(self) -> None:
        if not self.id.startswith(ID_PREFIXES.get(self.api, "\0")):
            raise ValueError(f"a {self.api} batch id starts with {ID_PREFIXES.get(self.api)!r}, got {self.id!r}")
        if self.status not in BATCH_STATUSES:
            raise ValueError(f"status must be one of {', '.join(BATCH_STATUSES)}, got {self.status!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if unknown := set(self.status_times) - set(STATUS_TIME_FIELDS):
            raise ValueError(f"status_times: unknown {', '.join(sorted(unknown))}")

    @property
    def completion_window_s(self) -> float:
        return self.expires_at - self.created_at

    @property
    def processing_status(self) -> ProcessingStatus:
        """Anthropic's status of the same batch."""
        if self.status in FINAL_STATUSES:
            return "ended"
        return "canceling" if self.status == "cancelling" else "in_progress"

    @property
    def ended_at(self) -> float | None:
        """When processing ended (Anthropic's ended_at): the final status's time."""
        for name in ("completed_at", "cancelled_at", "expired_at", "failed_at"):
            if self.status in FINAL_STATUSES and name in self.status_times:
                return self.status_times[name]
        return None


def new_batch(api: BatchApi, key_id: str, endpoint: str, *, now: float, input_file_id: str | None = None,
              metadata: Mapping[str, str] | None = None, completion_window_s: float = DEFAULT_COMPLETION_WINDOW_S,
              errors: Sequence[JSONObject] = (), upstream: str | None = None) -> Batch:
    """A batch to create: in_progress, or failed when `errors` (its input refused) are given.
    upstream: the replica whose Batch API runs it whole (Batch.upstream)."""
    if completion_window_s <= 0:
        raise ValueError(f"completion_window_s must be > 0, got {completion_window_s}")
    status: BatchStatus = "failed" if errors else "in_progress"
    return Batch(new_batch_id(api), key_id, api, endpoint, input_file_id, status, now, now + completion_window_s,
                 {f"{status}_at": now}, metadata, tuple(errors), None, None, BatchCounts(0), None,
                 upstream if not errors else None)


@dataclass(frozen=True, slots=True)
class QueueOverview:
    """The whole queue as one read of the database saw it (every key's, so the same on every
    gateway sharing it): what the dashboard and /metrics show."""

    num_batches_by_status: Mapping[BatchStatus, int]  # every batch kept, the ended ones too
    num_lines_pending: int  # waiting for a runner to claim them
    num_lines_claimed: int  # held by a runner: running, or deferred after a 429 or 503
    running: tuple[Batch, ...]  # in_progress or cancelling, the oldest first (up to the limit asked)


T = TypeVar("T", "StoredFile", "Batch")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """A page of a list, in the order asked: OpenAI's list object's contents."""

    data: tuple[T, ...]
    has_more: bool

    @property
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None

    @property
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None


# (the batch as it will be stored, the models its lines' bodies name: None for a body whose model is
# not a string) -> the upstream to run it whole, or None.
ChooseUpstream = Callable[[Batch, frozenset[str | None]], str | None]


class BatchStoreUnavailable(ServiceUnavailableError):
    """The database batches are kept in cannot be reached; retry_after: when the store tries it
    next (until then it refuses at once rather than make each call wait out a timeout)."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("Files and batches cannot be read or written now: their database is unreachable.",
                         retry_after=retry_after_s, code="batch_store_unavailable")


class BatchNotEndedError(InvalidRequestError):
    """Deleting a batch still running (Anthropic's 400 for it)."""

    def __init__(self, batch_id: str, status: str) -> None:
        super().__init__(f"Batch {batch_id} cannot be deleted while it is {status}; cancel it, and delete it once "
                         "it has ended.")


class BatchStore(Protocol):
    """Every call runs its query off the event loop. A database down raises BatchStoreUnavailable
    (a 503 with Retry-After); a closed store, RuntimeError."""

    async def create_file(self, file: StoredFile, content: bytes) -> None:
        """ValueError when len(content) is not file.bytes."""
        ...

    async def get_file(self, file_id: str, key_id: str) -> StoredFile | None: ...

    async def file_content(self, file_id: str, key_id: str) -> bytes | None: ...

    async def list_files(self, key_id: str, *, purpose: FilePurpose | None = None, after: str | None = None,
                         limit: int = 20, order: Literal["asc", "desc"] = "desc") -> Page[StoredFile]:
        """By created_at, from the file after `after` (a file id of this key's: FieldError
        "after" else)."""
        ...

    async def delete_file(self, file_id: str, key_id: str) -> bool:
        """The batches made from it keep their lines: they run on."""
        ...

    async def create_batch(self, batch: Batch, lines: PackedLines | Sequence[tuple[str, JSONObject]]) -> Batch:
        """The batch (new_batch's) and its lines, in the input's order (packed, as the APIs read
        them: packed.py; or (custom_id, body) pairs), in one transaction, written a chunk at a
        time; the batch as stored (its counts, its model from the first line's body unless
        batch.model is set). A failed batch has no lines."""
        ...

    async def get_batch(self, batch_id: str, key_id: str) -> Batch | None: ...

    def on_created(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) after each batch this store creates, once it is
        stored: a runner in this process wakes for it rather than at its next look."""
        ...

    def on_cancelled(self, callback: Callable[[str], None]) -> None:
        """Call `callback(batch_id)` (on the event loop) when this store moves a batch to
        cancelling: a runner in this process stops its lines of it at once."""
        ...

    def forward_with(self, choose: ChooseUpstream) -> None:
        """Each in_progress batch created from now on is offered to `choose` before it is
        stored: the upstream it names (Batch.upstream) runs the batch whole; None, its lines run here."""
        ...

    async def list_batches(self, key_id: str, *, api: BatchApi, after: str | None = None,
                           limit: int = 20) -> Page[Batch]:
        """Newest first, from the batch after `after` (FieldError "after" when the key has no such batch)."""
        ...

    async def delete_batch(self, batch_id: str, key_id: str) -> bool:
        """An ended batch (a final status), its lines and its output and error files, deleted;
        False when the key has no such batch. BatchNotEndedError while it runs: cancel it first."""
        ...

    async def purge_files(self, now: float) -> int:
        """Delete the files whose expires_at has passed; how many. Then give back the space that
        deleted files and batches left (SQLite: an incremental vacuum, a few MiB a step, and the
        WAL truncated; PostgreSQL's autovacuum does this itself)."""
        ...

    async def cancel_batch(self, batch_id: str, key_id: str) -> Batch | None:
        """An in_progress batch ─► cancelling, its lines not started ─► cancelled (those running
        finish and are kept); once none runs, finalize_ready makes it cancelled. Any other
        status is left as it is. The batch as it is now; None when the key has no such batch."""
        ...

    async def claim(self, worker_id: str, limit: int, lease_s: float, now: float) -> list[BatchLine]:
        """Up to `limit` lines to run, claimed by worker_id until now + lease_s: lines not started,
        and lines whose claim lapsed (their worker stopped renewing: it died), of in_progress
        batches, the oldest batch first, in line order. Never a line another worker holds.
        A lapsed line already tried MAX_ATTEMPTS times is failed instead of claimed again."""
        ...

    async def renew(self, worker_id: str, lines: Sequence[BatchLine], lease_until: float) -> int:
        """Extend worker_id's claims on those of `lines` it still holds; how many."""
        ...

    async def finish(self, worker_id: str, line: BatchLine, outcome: LineOutcome) -> bool:
        """Write the line's outcome if worker_id still holds its claim and it is not done: False
        otherwise (another worker took the lapsed claim, or the batch expired), and nothing is
        written. A line's outcome is written once."""
        ...

    async def defer(self, worker_id: str, line: BatchLine, until: float) -> bool:
        """Keep worker_id's claim on the line until `until` (unix time) without running it, and
        not count this run among its attempts: a line refused for now (rate limits, capacity)
        is claimed again by any runner once `until` passes. False if the claim is not worker_id's."""
        ...

    async def finalize_ready(self, now: float) -> tuple[str, ...]:
        """Every batch in_progress or cancelling whose lines are all done: its output and error
        files written (OpenAI's output and error lines; an Anthropic batch's results in its
        output file), and its status completed, cancelled, or expired (expire() marked it);
        their ids. Also fails the lapsed claims of cancelling batches (cancelled: no runner
        takes them again). Idempotent: concurrent calls finalize a batch once."""
        ...

    async def expire(self, now: float) -> tuple[str, ...]:
        """Every in_progress batch past expires_at: its lines not running (not started, or claims
        lapsed) ─► expired, and the batch ─► expired, finalized as finalize_ready does, once no
        line runs (a line still running is awaited: its result is kept). The ids expired now."""
        ...

    async def results(self, batch_id: str, key_id: str) -> AsyncIterator[tuple[BatchLine, LineOutcome]] | None:
        """The batch's lines done and their outcomes, in line order, read a page at a time as
        the iterator is consumed (Anthropic's results); None when the key has no such batch."""
        ...

    async def take_forwarded(self, now: float, lease_s: float, limit: int) -> list[Batch]:
        """Batches an upstream runs (Batch.upstream) that are due for a step, in_progress or
        cancelling, each leased until now + lease_s: one gateway at a time submits, polls or
        cancels a batch there. Their counts are left empty."""
        ...

    async def lines_of(self, batch_id: str) -> list[tuple[int, str, JSONObject]]:
        """Every line of the batch, (index, custom_id, body), in order: what an upstream is sent."""
        ...

    async def set_upstream(self, batch_id: str, upstream_batch_id: str | None, next_at: float) -> bool:
        """The batch's lease set to next_at (its next step); with upstream_batch_id, that id is
        recorded if the batch has none and is still in_progress: False when it is not (cancelled
        or expired meanwhile), and the caller cancels what it made there."""
        ...

    async def finish_forwarded(self, batch_id: str, results: Sequence[tuple[int, LineOutcome]],
                               rest: LineOutcome | None = None) -> int:
        """A forwarded batch's lines' outcomes, (index, outcome): each written unless the line is
        done (exactly once, however often the upstream's results are read); then, with `rest`
        (no response: cancelled, expired, or failed with an error), every line still undone ends
        so. How many of `results` were written. finalize_ready does the rest, as for any batch."""
        ...

    async def overview(self, limit: int) -> QueueOverview:
        """Every key's batches and lines, counted; the `limit` oldest running batches with their
        counts. Reads the running lines' index, and the running batches' lines for their counts."""
        ...

    async def close(self) -> None:
        """Finish the queries under way, then close every connection. Idempotent."""
        ...


def open_batch_store(url: str, *, num_connections: int = DEFAULT_NUM_CONNECTIONS) -> BatchStore:
    """url: the ledger's database (sqlite:///abs/path.db or postgresql://...), or "memory": an
    SQLite database in this process, lost when it exits (one connection). Opens nothing yet: each
    connection is opened, and the schema made if missing, by the first query that needs it."""
    from functools import partial

    from tokenway.batches.database import SqlBatchStore
    from tokenway.batches.sqlite_backend import SqliteBatchBackend

    if num_connections < 1:
        raise ValueError(f"num_connections must be >= 1, got {num_connections}")
    if url == "memory":
        # One connection: an SQLite :memory: database is private to the connection that made it.
        return SqlBatchStore(partial(SqliteBatchBackend, ":memory:"), 1, "memory")
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path or path == "/:memory:":
            raise ValueError(f"batch store url {url!r}: use sqlite:///absolute/path.db, or 'memory'")
        return SqlBatchStore(partial(SqliteBatchBackend, path), num_connections, url)
    if url.startswith(("postgresql://", "postgres://")):
        from tokenway.batches.postgres_backend import PostgresBatchBackend, connect_kwargs

        kwargs = connect_kwargs(url)  # a malformed url is a configuration error: found now, not per call
        return SqlBatchStore(partial(PostgresBatchBackend, url, kwargs), num_connections, url.split("@", 1)[-1])
    raise ValueError(f"batch store url {url!r}: expected sqlite:///path.db, postgresql://... or 'memory'")
