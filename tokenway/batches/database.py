"""SqlBatchStore: the BatchStore over one database, its queries on threads of its own.

    event loop ── store.claim(...) ──► outage? ── refuse at once: BatchStoreUnavailable (503, Retry-After)
                                          │ no
                                          ▼
    executor: num_connections threads, each with its own backend (connection), opened by its
    first query ──► the query; a transient failure: once more on a new connection, then an outage

An outage (the database failed twice running) makes every call refuse at once until its retry
time, 0.5 s doubling to 5 s, so a database host gone silent costs the first call a timeout
rather than every call one; the first call after that time tries again, and its success ends it.
The log gets one line as an outage starts and one as it ends. (The response store,
conversations/database.py, handles its outages the same way.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

from tokenway.batches.backend import RESULTS_PAGE, BatchBackend
from tokenway.batches.store import (
    FINAL_STATUSES,
    MAX_PAGE_ITEMS,
    Batch,
    BatchApi,
    BatchCounts,
    BatchLine,
    BatchNotEndedError,
    BatchStoreUnavailable,
    FilePurpose,
    JSONObject,
    LineOutcome,
    Page,
    QueueOverview,
    StoredFile,
)
from tokenway.protocol.errors import FieldError, truncate
from tokenway.sql import is_transient

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
PURGE_BATCH = 500  # files a purge deletes a statement: a write lock (SQLite's is the ledger's too) held briefly


@dataclass(frozen=True, slots=True)
class Outage:
    since: float  # unix time of the failure that began it
    backoff_s: float
    retry_at: float  # time.monotonic(): before it, calls are refused without trying the database


def _check_page(limit: int, order: str = "desc") -> None:
    if not 1 <= limit <= MAX_PAGE_ITEMS:
        raise FieldError("limit", f"must be between 1 and {MAX_PAGE_ITEMS}, got {limit}")
    if order not in ("asc", "desc"):
        raise FieldError("order", f"must be 'asc' or 'desc', got {truncate(str(order))!r}")


class SqlBatchStore:
    def __init__(self, connect: Callable[[], BatchBackend], num_connections: int, name: str) -> None:
        """connect: opens one backend (a connection; the schema made if missing). name: the
        database for the log, without a password."""
        self._connect = connect
        self._name = name
        self._executor = ThreadPoolExecutor(max_workers=num_connections, thread_name_prefix="batch-store")
        self._local = threading.local()  # .backend: the executor thread's own connection
        self._backends: list[BatchBackend] = []  # every one open, to close them all at the end
        self._backends_lock = threading.Lock()
        # Connections are opened one at a time: each makes the schema if missing (and SQLite's
        # switch to WAL), which concurrent openers on one new file would otherwise fight over.
        self._opening = threading.Lock()
        self._outage: Outage | None = None  # swapped whole; read on the event loop, written by the threads
        self._closed = False

    # ---- files ----

    async def create_file(self, file: StoredFile, content: bytes) -> None:
        if len(content) != file.bytes:
            raise ValueError(f"file {file.id} says {file.bytes} bytes, its content has {len(content)}")
        await self._run(lambda backend: backend.create_file(file, content))

    async def get_file(self, file_id: str, key_id: str) -> StoredFile | None:
        return await self._run(lambda backend: backend.get_file(file_id, key_id))

    async def file_content(self, file_id: str, key_id: str) -> bytes | None:
        return await self._run(lambda backend: backend.file_content(file_id, key_id))

    async def list_files(self, key_id: str, *, purpose: FilePurpose | None = None, after: str | None = None,
                         limit: int = 20, order: Literal["asc", "desc"] = "desc") -> Page[StoredFile]:
        _check_page(limit, order)
        files, has_more = await self._run(lambda backend: backend.list_files(key_id, purpose, after, limit, order))
        return Page(tuple(files), has_more)

    async def delete_file(self, file_id: str, key_id: str) -> bool:
        return await self._run(lambda backend: backend.delete_file(file_id, key_id))

    async def purge_files(self, now: float) -> int:
        def purge_all(backend: BatchBackend) -> int:
            num_deleted = 0
            while (num := backend.purge_files(now, PURGE_BATCH)) > 0:
                num_deleted += num
                if num < PURGE_BATCH:
                    break
            return num_deleted

        return await self._run(purge_all)

    # ---- batches ----

    async def create_batch(self, batch: Batch, lines: Sequence[tuple[str, JSONObject]]) -> Batch:
        if batch.status not in ("in_progress", "failed"):
            raise ValueError(f"a batch is created in_progress or failed (its input refused), not {batch.status}")
        if batch.status == "failed" and lines:
            raise ValueError("a failed batch has no lines to run")
        if len({custom_id for custom_id, _ in lines}) != len(lines):
            raise ValueError("a batch's custom_ids must be unique")
        model = batch.model
        if model is None and lines and isinstance(lines[0][1].get("model"), str):
            model = lines[0][1]["model"]
        stored = dataclasses.replace(batch, model=model, counts=BatchCounts(len(lines), pending=len(lines)))
        await self._run(lambda backend: backend.create_batch(stored, lines))
        return stored

    async def get_batch(self, batch_id: str, key_id: str) -> Batch | None:
        return await self._run(lambda backend: backend.get_batch(batch_id, key_id))

    async def list_batches(self, key_id: str, *, api: BatchApi, after: str | None = None,
                           limit: int = 20) -> Page[Batch]:
        _check_page(limit)
        batches, has_more = await self._run(lambda backend: backend.list_batches(key_id, api, after, limit))
        return Page(tuple(batches), has_more)

    async def delete_batch(self, batch_id: str, key_id: str) -> bool:
        status = await self._run(lambda backend: backend.delete_batch(batch_id, key_id))
        if status is not None and status not in FINAL_STATUSES:
            raise BatchNotEndedError(batch_id, status)
        return status is not None

    async def cancel_batch(self, batch_id: str, key_id: str) -> Batch | None:
        now = time.time()

        def cancel(backend: BatchBackend) -> Batch | None:
            if backend.cancel_batch(batch_id, key_id, now):
                backend.finalize(batch_id, now)  # at once when no line was running
            return backend.get_batch(batch_id, key_id)

        return await self._run(cancel)

    async def results(self, batch_id: str, key_id: str) -> AsyncIterator[tuple[BatchLine, LineOutcome]] | None:
        if not await self._run(lambda backend: backend.owns(batch_id, key_id)):
            return None
        return self._results(batch_id)

    async def _results(self, batch_id: str) -> AsyncIterator[tuple[BatchLine, LineOutcome]]:
        after_index = -1
        while True:
            page = await self._run(lambda backend, after=after_index: backend.results_page(batch_id, after,
                                                                                            RESULTS_PAGE))
            for result in page:
                yield result
            if len(page) < RESULTS_PAGE:
                return
            after_index = page[-1][0].index

    # ---- the runners' side ----

    async def claim(self, worker_id: str, limit: int, lease_s: float, now: float) -> list[BatchLine]:
        if limit < 1 or lease_s <= 0:
            raise ValueError(f"claim needs limit >= 1 and lease_s > 0, got {limit} and {lease_s}")
        return await self._run(lambda backend: backend.claim(worker_id, limit, lease_s, now))

    async def renew(self, worker_id: str, lines: Sequence[BatchLine], lease_until: float) -> int:
        if not lines:
            return 0
        return await self._run(lambda backend: backend.renew(worker_id, lines, lease_until))

    async def finish(self, worker_id: str, line: BatchLine, outcome: LineOutcome) -> bool:
        if outcome.outcome not in ("succeeded", "failed"):
            raise ValueError(f"a line a worker ran has succeeded or failed, not {outcome.outcome}")
        now = time.time()
        return await self._run(lambda backend: backend.finish(worker_id, line, outcome, now))

    async def defer(self, worker_id: str, line: BatchLine, until: float) -> bool:
        return await self._run(lambda backend: backend.defer(worker_id, line, until))

    async def finalize_ready(self, now: float) -> tuple[str, ...]:
        def finalize_all(backend: BatchBackend) -> tuple[str, ...]:
            return tuple(batch_id for batch_id in backend.ready(now) if backend.finalize(batch_id, now) is not None)

        return await self._run(finalize_all)

    async def expire(self, now: float) -> tuple[str, ...]:
        def expire_all(backend: BatchBackend) -> tuple[str, ...]:
            expired = []
            for batch_id in backend.expirable(now):
                backend.mark_expired(batch_id, now)
                if backend.finalize(batch_id, now) == "expired":
                    expired.append(batch_id)
            return tuple(expired)

        return await self._run(expire_all)

    async def overview(self, limit: int) -> QueueOverview:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return await self._run(lambda backend: backend.overview(limit))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._executor.shutdown)  # the queries under way finish first
        with self._backends_lock:
            backends, self._backends = self._backends, []
        for backend in backends:
            _close_quietly(backend)

    # ---- the threads ----

    async def _run(self, query: Callable[[BatchBackend], T]) -> T:
        if self._closed:
            raise RuntimeError("the batch store is closed")
        outage = self._outage
        if outage is not None and (wait_s := outage.retry_at - time.monotonic()) > 0:
            raise BatchStoreUnavailable(wait_s)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._query, query)

    def _query(self, query: Callable[[BatchBackend], T]) -> T:
        """On an executor thread."""
        error: Exception | None = None
        # A connection that fails gets one more try on a new one: the database may have dropped
        # it (a restart, an idle timeout). A new one that fails does not: the next would wait out
        # the same connect timeout. Every write is safe to try twice: inserts of an id there
        # already are no-ops, and a claim made twice leaves the first's lines to their lease.
        for _ in range(2):
            backend: BatchBackend | None = getattr(self._local, "backend", None)
            reused = backend is not None
            try:
                if backend is None:
                    backend = self._local.backend = self._open()
                result = query(backend)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._drop(backend)
                error = exc
                if reused:
                    continue
                break
            if (outage := self._outage) is not None:
                self._outage = None
                logger.info("batch store: %s is reachable again, after %.0f s", self._name,
                            time.time() - outage.since)
            return result
        previous = self._outage
        backoff_s = RETRY_FIRST_S if previous is None else min(2 * previous.backoff_s, RETRY_MAX_S)
        if previous is None:
            logger.warning("batch store: %s is unreachable (%r); calls are refused with 503 until it is back",
                           self._name, error)
        since = time.time() if previous is None else previous.since
        self._outage = Outage(since, backoff_s, time.monotonic() + backoff_s)
        raise BatchStoreUnavailable(backoff_s) from error

    def _open(self) -> BatchBackend:
        with self._opening:
            backend = self._connect()
        with self._backends_lock:
            self._backends.append(backend)
        return backend

    def _drop(self, backend: BatchBackend | None) -> None:
        self._local.backend = None
        if backend is not None:
            with self._backends_lock:
                if backend in self._backends:
                    self._backends.remove(backend)
            _close_quietly(backend)


def _close_quietly(backend: BatchBackend) -> None:
    try:
        backend.close()
    except Exception:  # already failing, or closing at shutdown: the connection is dropped either way
        pass
