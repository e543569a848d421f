"""The background responses a server runs (server/responses_background.py runs each): a task per
response, by its id, held by Services (like Capacity, state a request changes, owned here), and
the upkeep of the stored responses, on a timer once start() has run:

    every lease_s / 3 ─► renew: this server's running responses' leases, to now + lease_s, each
                        with its usage so far (what it has generated: follow())
                     ─► expire: every response still queued or in progress whose lease has
                        passed (the server running it stopped: killed, crashed, its host gone)
                        is stored failed, by whichever server sees it first, and billed
                        (bill: its one ledger row, from the usage its server last kept)
                     ─► purge (ttl_s set; every ttl_s / 10, at most hourly): the finished
                        responses created more than ttl_s ago are deleted
    and once at start, so a server restarted on its database fails what it left running.

Leases, not a server's own list, decide what is abandoned: gateways sharing a PostgreSQL each run
responses, and one starting up must not fail another's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tokenway.conversations import ResponseStore, ResponseUsage, StoredResponse
from tokenway.conversations.store import JSONObject
from tokenway.protocol.errors import ServiceUnavailableError, TokenwayError

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 60.0  # renewed every 20 s: a gateway's clock may be that far off another's before it matters
MAX_PURGE_INTERVAL_S = 3600.0
ABANDONED = "The server running this response stopped before it finished; create it again."
NOTHING_YET = ResponseUsage()

# What bills a response whose server stopped while it ran (responses_background.py bill_abandoned).
Bill = Callable[[StoredResponse], Awaitable[None]]


def abandoned(response: JSONObject) -> JSONObject:
    """A response whose server stopped while it ran, as stored at its end."""
    return {**response, "status": "failed", "error": {"code": "server_error", "message": ABANDONED}}


class BackgroundResponses:
    """The background responses running in this server, by response id. Only the event loop
    touches it."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._response_id_to_usage: dict[str, Callable[[], ResponseUsage]] = {}  # follow()'s
        self.closing = False  # the server is shutting down: a task cancelled now did not ask for it
        self.lease_s = DEFAULT_LEASE_S  # how long a response created here is held without a renewal
        self._upkeep: asyncio.Task[None] | None = None

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    def check_open(self) -> None:
        """A 503 once the server is shutting down: a response made now could not run."""
        if self.closing:
            raise ServiceUnavailableError("The server is shutting down; create the response again.", retry_after=1)

    def spawn(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        if self.closing:
            work.close()
        self.check_open()
        task = asyncio.get_running_loop().create_task(work, name=f"background {response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._forget(response_id))

    def follow(self, response_id: str, usage: Callable[[], ResponseUsage]) -> None:
        """usage(): what the running response has used so far, kept with each renewal of its
        lease (until then, and once it ends, nothing is)."""
        if response_id in self._tasks:
            self._response_id_to_usage[response_id] = usage

    def _forget(self, response_id: str) -> None:
        self._tasks.pop(response_id, None)
        self._response_id_to_usage.pop(response_id, None)

    def _usage(self) -> dict[str, ResponseUsage]:
        usage_of = self._response_id_to_usage
        return {response_id: usage_of[response_id]() if response_id in usage_of else NOTHING_YET
                for response_id in self._tasks}

    def cancel(self, response_id: str) -> bool:
        """Stop the response's generation, if it runs here."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        if not task.cancelling():  # once: a second cancel would cut short how it records its end
            task.cancel()
        return True

    def start(self, store: ResponseStore, *, lease_s: float = DEFAULT_LEASE_S, ttl_s: float | None = None,
              bill: Bill | None = None) -> None:
        """The stored responses' upkeep (the module's docstring), on the running loop, until
        aclose(). bill: called once for each response this server fails for its stopped server
        (None: nothing bills them)."""
        if not lease_s > 0 or ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"lease_s and ttl_s must be > 0, got {lease_s!r} and {ttl_s!r}")
        assert self._upkeep is None, "the upkeep starts once"
        self.lease_s = lease_s
        self._upkeep = asyncio.get_running_loop().create_task(self._keep(store, ttl_s, bill),
                                                              name="responses upkeep")

    async def _keep(self, store: ResponseStore, ttl_s: float | None, bill: Bill | None) -> None:
        purge_at = 0.0  # time.monotonic() of the next purge
        while True:
            now = time.time()
            try:
                await store.renew(self._usage(), now + self.lease_s)
                expired = await store.expire(now, abandoned)
                if expired:
                    logger.warning("background responses whose server stopped while they ran, stored failed: %s",
                                   ", ".join(stored.id for stored in expired))
                if bill is not None:
                    for stored in expired:
                        await _bill_one(bill, stored)
                if ttl_s is not None and time.monotonic() >= purge_at:
                    num_purged = await store.purge(now - ttl_s)
                    purge_at = time.monotonic() + min(ttl_s / 10, MAX_PURGE_INTERVAL_S)
                    if num_purged:
                        logger.info("stored responses older than their TTL (%g s), deleted: %d", ttl_s, num_purged)
            except TokenwayError as exc:  # the store is down: the next round tries again
                logger.warning("stored responses' upkeep: %s", exc.message)
            except Exception:  # a bug: logged whole, and the upkeep goes on
                logger.exception("stored responses' upkeep failed")
            await asyncio.sleep(self.lease_s / 3)

    async def aclose(self) -> None:
        """Cancel every task and wait for each to record how it ended; then stop the upkeep."""
        self.closing = True
        tasks = list(self._tasks.values())
        for task in tasks:
            if not task.cancelling():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        upkeep, self._upkeep = self._upkeep, None
        if upkeep is not None:
            upkeep.cancel()
            await asyncio.gather(upkeep, return_exceptions=True)


async def _bill_one(bill: Bill, stored: StoredResponse) -> None:
    # Each its own try: one whose row cannot be written now does not cost the others theirs.
    try:
        await bill(stored)
    except Exception:
        logger.exception("background response %s, failed for its stopped server, is not billed", stored.id)
