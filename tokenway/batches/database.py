"""SqlBatchStore: the BatchStore over one database, its queries on threads of their own
(tokenway/sql.py DatabaseThreads: an outage refuses calls at once with BatchStoreUnavailable, a
503 with Retry-After, 0.5 s doubling to 5 s, until the database answers again)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal, TypeVar

from tokenway.batches.backend import RESULTS_PAGE, BatchBackend
from tokenway.batches.packed import PackedLines
from tokenway.batches.store import (
    FINAL_STATUSES,
    MAX_PAGE_ITEMS,
    Batch,
    BatchApi,
    BatchCounts,
    BatchLine,
    BatchNotEndedError,
    BatchStoreUnavailable,
    ChooseUpstream,
    FilePurpose,
    JSONObject,
    LineOutcome,
    Page,
    QueueOverview,
    StoredFile,
)
from tokenway.protocol.errors import FieldError, truncate
from tokenway.sql import DatabaseThreads

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
PURGE_BATCH = 500  # files a purge deletes a statement: a write lock (SQLite's is the ledger's too) held briefly


def _check_page(limit: int, order: str = "desc") -> None:
    if not 1 <= limit <= MAX_PAGE_ITEMS:
        raise FieldError("limit", f"must be between 1 and {MAX_PAGE_ITEMS}, got {limit}")
    if order not in ("asc", "desc"):
        raise FieldError("order", f"must be 'asc' or 'desc', got {truncate(str(order))!r}")


class SqlBatchStore:
    def __init__(self, connect: Callable[[], BatchBackend], num_connections: int, name: str) -> None:
        """connect: opens one backend (a connection; the schema made if missing). name: the
        database for the log, without a password."""
        # Every write is safe to try twice: inserts of an id there already are no-ops, and a
        # claim made twice leaves the first's lines to their lease.
        self._threads = DatabaseThreads(connect, num_connections, name, what="batch store",
                                        unavailable=BatchStoreUnavailable, retry_first_s=RETRY_FIRST_S,
                                        retry_max_s=RETRY_MAX_S, log=logger)
        self._created_callbacks: list[Callable[[], None]] = []
        self._cancelled_callbacks: list[Callable[[str], None]] = []
        self._choose_upstream: ChooseUpstream | None = None

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
            backend.reclaim()
            return num_deleted

        return await self._run(purge_all)

    # ---- batches ----

    async def create_batch(self, batch: Batch, lines: PackedLines | Sequence[tuple[str, JSONObject]]) -> Batch:
        if batch.status not in ("in_progress", "failed"):
            raise ValueError(f"a batch is created in_progress or failed (its input refused), not {batch.status}")
        if batch.status == "failed" and len(lines):
            raise ValueError("a failed batch has no lines to run")
        packed = lines if isinstance(lines, PackedLines) else PackedLines.of(lines)  # ValueError: a repeat
        model = batch.model if batch.model is not None else packed.first_model
        stored = dataclasses.replace(batch, model=model, counts=BatchCounts(len(packed), pending=len(packed)))
        if stored.status == "in_progress" and stored.upstream is None and self._choose_upstream is not None:
            stored = dataclasses.replace(stored, upstream=self._choose_upstream(stored, packed.models))
        await self._run(lambda backend: backend.create_batch(stored, packed))
        if stored.status == "in_progress":
            for callback in self._created_callbacks:
                callback()
        return stored

    def on_created(self, callback: Callable[[], None]) -> None:
        self._created_callbacks.append(callback)

    def on_cancelled(self, callback: Callable[[str], None]) -> None:
        self._cancelled_callbacks.append(callback)

    def forward_with(self, choose: ChooseUpstream) -> None:
        self._choose_upstream = choose

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

        def cancel(backend: BatchBackend) -> tuple[bool, Batch | None]:
            moved = backend.cancel_batch(batch_id, key_id, now)
            if moved:
                backend.finalize(batch_id, now)  # at once when no line was running
            return moved, backend.get_batch(batch_id, key_id)

        moved, batch = await self._run(cancel)
        if moved and batch is not None and batch.status == "cancelling":
            for callback in self._cancelled_callbacks:
                callback(batch_id)
        return batch

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

    async def take_forwarded(self, now: float, lease_s: float, limit: int) -> list[Batch]:
        if limit < 1 or lease_s <= 0:
            raise ValueError(f"take_forwarded needs limit >= 1 and lease_s > 0, got {limit} and {lease_s}")
        return await self._run(lambda backend: backend.take_forwarded(now, lease_s, limit))

    async def lines_of(self, batch_id: str) -> list[tuple[int, str, JSONObject]]:
        return await self._run(lambda backend: backend.lines_of(batch_id))

    async def set_upstream(self, batch_id: str, upstream_batch_id: str | None, next_at: float) -> bool:
        return await self._run(lambda backend: backend.set_upstream(batch_id, upstream_batch_id, next_at))

    async def finish_forwarded(self, batch_id: str, results: Sequence[tuple[int, LineOutcome]],
                               rest: LineOutcome | None = None) -> int:
        if rest is not None and rest.response is not None:
            raise ValueError("the lines left end without a response: cancelled, expired, or failed with an error")
        now = time.time()
        return await self._run(lambda backend: backend.finish_forwarded(batch_id, results, rest, now))

    async def overview(self, limit: int) -> QueueOverview:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return await self._run(lambda backend: backend.overview(limit))

    async def close(self) -> None:
        await self._threads.close()

    async def _run(self, query: Callable[[BatchBackend], T]) -> T:
        return await self._threads.run(query)
