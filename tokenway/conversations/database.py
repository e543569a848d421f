"""SqlResponseStore: the ResponseStore over one database, its queries on threads of their own
(tokenway/sql.py DatabaseThreads: an outage refuses calls at once with ResponseStoreUnavailable,
a 503 with Retry-After, 0.5 s doubling to 5 s, until the database answers again).

keep() inserts off the reply's path (a commit is ~0.3 ms the caller need not wait for): the
insert's first try is tracked until it ends, and every other call waits for the tries under way
before its own query, so a client that continues a response the moment it has it finds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

from tokenway.conversations.backend import PURGE_BATCH, ResponseBackend
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
    ResponseUsage,
    StoredResponse,
    Turn,
    check_status,
)
from tokenway.protocol.errors import FieldError, truncate
from tokenway.sql import DatabaseThreads

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
RENEW_BATCH = 500  # responses a transaction: a write lock (SQLite's is the ledger's too) held briefly
# A response running without a lease was made by a server from before leases (a gateway not yet
# upgraded, sharing the database): it is abandoned only once it is older than any reply takes.
UNLEASED_GRACE_S = 3600.0


class SqlResponseStore:
    def __init__(self, connect: Callable[[], ResponseBackend], num_connections: int, name: str) -> None:
        """connect: opens one backend (a connection; the schema made if missing). name: the
        database for the log, without a password."""
        self._name = name
        # An insert retried after a commit whose reply was lost is a no-op.
        self._threads = DatabaseThreads(connect, num_connections, name, what="response store",
                                        unavailable=ResponseStoreUnavailable, retry_first_s=RETRY_FIRST_S,
                                        retry_max_s=RETRY_MAX_S, log=logger)
        self._first_tries: set[asyncio.Future[None]] = set()  # keep()'s inserts whose first try is under way
        self._keeping: set[asyncio.Task[None]] = set()  # keep()'s inserts not yet committed or given up

    async def create(self, response: StoredResponse) -> None:
        await self._run(lambda backend: backend.insert(response))

    def keep(self, response: StoredResponse) -> None:
        if self._threads.closed:
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
                    await self._threads.run(lambda backend: backend.insert(response))
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

    async def renew(self, response_id_to_usage: Mapping[str, ResponseUsage], lease_until: float) -> int:
        if not response_id_to_usage:
            return 0
        response_ids = list(response_id_to_usage)

        def renew_all(backend: ResponseBackend) -> int:
            return sum(backend.renew({response_id: response_id_to_usage[response_id]
                                      for response_id in response_ids[start:start + RENEW_BATCH]}, lease_until)
                       for start in range(0, len(response_ids), RENEW_BATCH))

        return await self._run(renew_all)

    async def expire(self, now: float, abandon: Callable[[JSONObject], JSONObject]) -> tuple[StoredResponse, ...]:
        unleased_before = now - UNLEASED_GRACE_S

        def expire_stale(backend: ResponseBackend) -> tuple[StoredResponse, ...]:
            expired = []
            for stale in backend.stale(now, unleased_before):
                response = abandon(stale.response)
                if backend.expire(stale.id, response, now, unleased_before):  # not renewed, nor failed elsewhere
                    expired.append(dataclasses.replace(stale, status="failed", response=response, lease_until=None))
            return tuple(expired)

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
        if self._threads.closed:
            return
        if self._keeping:  # inserts still going (through an outage) get the time of two more tries
            _, going = await asyncio.wait(list(self._keeping), timeout=2 * RETRY_MAX_S)
            for task in going:
                task.cancel()
            if going:
                logger.error("response store: %d responses are not stored: %s stayed unreachable until the "
                             "store closed", len(going), self._name)
        await self._threads.close()

    async def _run(self, query: Callable[[ResponseBackend], T]) -> T:
        await self._after_keeps()
        return await self._threads.run(query)
