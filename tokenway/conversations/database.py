"""SqlResponseStore: the ResponseStore over one database, its queries on threads of its own.

    event loop ── store.get(...) ──► outage? ── refuse at once: ResponseStoreUnavailable (503, Retry-After)
                                        │ no
                                        ▼
    executor: num_connections threads, each with its own backend (connection), opened by its
    first query ──► the query; a transient failure: once more on a new connection, then an outage

An outage (the database failed twice running) makes every call refuse at once until its
retry time, 0.5 s doubling to 5 s, so that a database host gone silent costs the first call a
timeout rather than every call one; the first call after that time tries the database again,
and its success ends the outage. The log gets one line when an outage starts and one when it ends.

keep() inserts off the reply's path (a commit is ~0.3 ms the caller need not wait for): the
insert's first try is tracked until it ends, and every other call waits for the tries under way
before its own query, so a client that continues a response the moment it has it finds it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

from tokenway.conversations.backend import PURGE_BATCH, ResponseBackend, close_quietly
from tokenway.conversations.store import (
    DEFAULT_CHAIN_LIMIT,
    KEEP_PATIENCE_S,
    MAX_PAGE_ITEMS,
    ORDERS,
    STATUS_TO_FROM_STATUSES,
    ConversationTooLongError,
    InputItemsPage,
    JSONObject,
    PreviousResponseNotFoundError,
    ResponseStatus,
    ResponseStoreUnavailable,
    StoredResponse,
    Turn,
    check_status,
)
from tokenway.protocol.errors import FieldError, truncate
from tokenway.sql import is_transient

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
RENEW_BATCH = 500  # ids a statement: far below either database's bound on parameters
# A response running without a lease was made by a server from before leases (a gateway not yet
# upgraded, sharing the database): it is abandoned only once it is older than any reply takes.
UNLEASED_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Outage:
    since: float  # unix time of the failure that began it
    backoff_s: float
    retry_at: float  # time.monotonic(): before it, calls are refused without trying the database


class SqlResponseStore:
    def __init__(self, connect: Callable[[], ResponseBackend], num_connections: int, name: str) -> None:
        """connect: opens one backend (a connection; the schema made if missing). name: the
        database for the log, without a password."""
        self._connect = connect
        self._name = name
        self._executor = ThreadPoolExecutor(max_workers=num_connections, thread_name_prefix="response-store")
        self._local = threading.local()  # .backend: the executor thread's own connection
        self._backends: list[ResponseBackend] = []  # every one open, to close them all at the end
        self._backends_lock = threading.Lock()
        # Connections are opened one at a time: each makes the schema if missing (and SQLite's
        # switch to WAL), which concurrent openers on one new file would otherwise fight over.
        self._opening = threading.Lock()
        self._outage: Outage | None = None  # swapped whole; read on the event loop, written by the threads
        self._closed = False
        self._first_tries: set[asyncio.Future[None]] = set()  # keep()'s inserts whose first try is under way
        self._keeping: set[asyncio.Task[None]] = set()  # keep()'s inserts not yet committed or given up

    async def create(self, response: StoredResponse) -> None:
        await self._run(lambda backend: backend.insert(response))

    def keep(self, response: StoredResponse) -> None:
        if self._closed:
            raise RuntimeError("the response store is closed")
        first_try = asyncio.get_running_loop().create_future()
        self._first_tries.add(first_try)
        task = asyncio.create_task(self._insert_patiently(response, first_try))
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    async def _insert_patiently(self, response: StoredResponse, first_try: asyncio.Future[None]) -> None:
        deadline = time.monotonic() + KEEP_PATIENCE_S
        try:
            while True:
                try:
                    await self._query_async(lambda backend: backend.insert(response))
                    return
                except ResponseStoreUnavailable as exc:
                    self._tried(first_try)
                    wait_s = exc.retry_after or RETRY_FIRST_S
                    if time.monotonic() + wait_s > deadline:
                        raise
                    await asyncio.sleep(wait_s)
                finally:
                    self._tried(first_try)
        except Exception as exc:  # nothing awaits the task: the log is where its failure goes
            logger.error("response store: response %s is not stored: %r", response.id, exc)
        except asyncio.CancelledError:  # the loop shut down under it (close() waits for it first)
            logger.error("response store: response %s is not stored: its insert was cancelled", response.id)
            raise

    def _tried(self, first_try: asyncio.Future[None]) -> None:
        if not first_try.done():
            first_try.set_result(None)
        self._first_tries.discard(first_try)

    async def _after_keeps(self) -> None:
        """Once every keep() begun so far has had its first try."""
        if self._first_tries:
            await asyncio.wait(list(self._first_tries))

    async def update(self, response_id: str, *, status: ResponseStatus, response: JSONObject) -> bool:
        check_status(status, response)
        from_statuses = STATUS_TO_FROM_STATUSES[status]
        return await self._run(lambda backend: backend.update(response_id, status, response, from_statuses))

    async def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        return await self._run(lambda backend: backend.get(response_id, key_id))

    async def delete(self, response_id: str, key_id: str) -> bool:
        return await self._run(lambda backend: backend.delete(response_id, key_id))

    async def chain(self, response_id: str, key_id: str, limit: int = DEFAULT_CHAIN_LIMIT) -> tuple[Turn, ...]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        turns = await self._run(lambda backend: backend.chain(response_id, key_id, limit))
        if not turns:
            raise PreviousResponseNotFoundError(f"Previous response with id '{truncate(response_id)}' not found.")
        if len(turns) > limit:
            raise ConversationTooLongError(response_id, limit)
        oldest = turns[0]
        if oldest.previous_response_id is not None:
            raise PreviousResponseNotFoundError(
                f"Previous response with id '{truncate(response_id)}' cannot be continued: the response "
                f"'{oldest.response_id}' in its conversation continues '{oldest.previous_response_id}', "
                "which was not found.")
        return tuple(turns)

    async def input_items(self, response_id: str, key_id: str, *, after: str | None = None, limit: int = 20,
                          order: Literal["asc", "desc"] = "desc") -> InputItemsPage | None:
        if not 1 <= limit <= MAX_PAGE_ITEMS:
            raise FieldError("limit", f"must be between 1 and {MAX_PAGE_ITEMS}, got {limit}")
        if order not in ORDERS:
            raise FieldError("order", f"must be 'asc' or 'desc', got {truncate(str(order))!r}")
        items = await self._run(lambda backend: backend.input_items(response_id, key_id))
        if items is None:
            return None
        ordered = items if order == "asc" else items[::-1]
        start = 0
        if after is not None:
            index = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
            if index is None:
                raise FieldError("after", f"the response has no input item with id {truncate(after)!r}")
            start = index + 1
        data = ordered[start:start + limit]
        return InputItemsPage(data, data[0]["id"] if data else None, data[-1]["id"] if data else None,
                              start + limit < len(ordered))

    async def renew(self, response_ids: Sequence[str], lease_until: float) -> int:
        if not response_ids:
            return 0

        def renew_all(backend: ResponseBackend) -> int:
            return sum(backend.renew(response_ids[start:start + RENEW_BATCH], lease_until)
                       for start in range(0, len(response_ids), RENEW_BATCH))

        return await self._run(renew_all)

    async def expire(self, now: float, abandon: Callable[[JSONObject], JSONObject]) -> tuple[str, ...]:
        unleased_before = now - UNLEASED_GRACE_S

        def expire_stale(backend: ResponseBackend) -> tuple[str, ...]:
            return tuple(response_id for response_id, response in backend.stale(now, unleased_before)
                         if backend.expire(response_id, abandon(response), now, unleased_before))

        return await self._run(expire_stale)

    async def purge(self, created_before: float) -> int:
        def purge_all(backend: ResponseBackend) -> int:
            num_deleted = 0
            while (num := backend.purge(created_before, PURGE_BATCH)) > 0:
                num_deleted += num
                if num < PURGE_BATCH:
                    break
            return num_deleted

        return await self._run(purge_all)

    async def close(self) -> None:
        if self._closed:
            return
        if self._keeping:  # inserts still going (through an outage) get the time of two more tries
            _, going = await asyncio.wait(list(self._keeping), timeout=2 * RETRY_MAX_S)
            for task in going:
                task.cancel()
            if going:
                logger.error("response store: %d responses are not stored: %s stayed unreachable until the "
                             "store closed", len(going), self._name)
        self._closed = True
        await asyncio.to_thread(self._executor.shutdown)  # the queries under way finish first
        with self._backends_lock:
            backends, self._backends = self._backends, []
        for backend in backends:
            close_quietly(backend)

    async def _run(self, query: Callable[[ResponseBackend], T]) -> T:
        await self._after_keeps()
        return await self._query_async(query)

    async def _query_async(self, query: Callable[[ResponseBackend], T]) -> T:
        if self._closed:
            raise RuntimeError("the response store is closed")
        outage = self._outage
        if outage is not None and (wait_s := outage.retry_at - time.monotonic()) > 0:
            raise ResponseStoreUnavailable(wait_s)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._query, query)

    def _query(self, query: Callable[[ResponseBackend], T]) -> T:
        """On an executor thread."""
        error: Exception | None = None
        # A connection that fails gets one more try on a new one: the database may have dropped
        # it (a restart, an idle timeout). A new one that fails does not: the next would wait out
        # the same connect timeout. An insert retried after a commit whose reply was lost is a no-op.
        for _ in range(2):
            backend: ResponseBackend | None = getattr(self._local, "backend", None)
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
                logger.info("response store: %s is reachable again, after %.0f s", self._name,
                            time.time() - outage.since)
            return result
        previous = self._outage
        backoff_s = RETRY_FIRST_S if previous is None else min(2 * previous.backoff_s, RETRY_MAX_S)
        if previous is None:
            logger.warning("response store: %s is unreachable (%r); calls are refused with 503 until it is back",
                           self._name, error)
        since = time.time() if previous is None else previous.since
        self._outage = Outage(since, backoff_s, time.monotonic() + backoff_s)
        raise ResponseStoreUnavailable(backoff_s) from error

    def _open(self) -> ResponseBackend:
        with self._opening:
            backend = self._connect()
        with self._backends_lock:
            self._backends.append(backend)
        return backend

    def _drop(self, backend: ResponseBackend | None) -> None:
        self._local.backend = None
        if backend is not None:
            with self._backends_lock:
                if backend in self._backends:
                    self._backends.remove(backend)
            close_quietly(backend)
