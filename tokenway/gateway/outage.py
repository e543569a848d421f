"""What the gateway does while its limits store (the limiter's and the budgets' Redis) is down.

    limits_on_error = "open"    the default: admit calls without the limits store's limits and
                                reservations (a budget falls back to the ledger's spend: a key
                                that has used it all is still refused), and say so in the log
    limits_on_error = "closed"  refuse them: 503 limits_unavailable with Retry-After

StoreGuard runs every call into the stores, each named "limits" or "budgets" (or both, for an
operation on both at once: joint_redis.py). A store that fails (LimitsUnavailable) is tried
again by one call a probe interval, and the calls in between go by the policy at once, so a
dead or black-holed Redis costs calls nothing but a probe now and then. One warning when an
outage starts (at most one a minute, however often the store flaps) and one line when it
ends; never a traceback per call. Budget settlements that could not be written are kept
(the newest max_unsettled) and replayed once the budgets' store answers again. Background work
(settlements, reconciles) runs as tasks the guard holds until done; close() waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from tokenway.gateway.limits import LimitsUnavailable
from tokenway.protocol.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)
T = TypeVar("T")

LIMITS_ON_ERROR = ("open", "closed")
LOG_INTERVAL_S = 60.0
# A store's name, or the names of the stores that one operation reads and writes.
Stores = str | tuple[str, ...]


def store_names(stores: Stores) -> tuple[str, ...]:
    return (stores,) if isinstance(stores, str) else stores


class StoreGuard:
    """The gateway's one way into its limits stores: a breaker per store, the policy, the log."""

    def __init__(self, on_error: str = "open", *, probe_interval_s: float = 1.0, max_unsettled: int = 100_000
                 ) -> None:
        if on_error not in LIMITS_ON_ERROR:
            raise ValueError(f"limits_on_error: expected one of {', '.join(LIMITS_ON_ERROR)}, got {on_error!r}")
        self.on_error = on_error
        self.probe_interval_s = probe_interval_s
        self._store_to_next_probe: dict[str, float] = {}  # the stores down now
        self._outage_started: float | None = None
        self._outage_logged = False
        self._last_logged = -LOG_INTERVAL_S
        self.num_calls_by_policy = 0  # in this outage: admitted without the stores (open) or refused (closed)
        # Settlements that failed, to replay: (the stores' names, the operation).
        self._unsettled: deque[tuple[Stores, Callable[[], Awaitable[None]]]] = deque(maxlen=max_unsettled)
        self._replaying = False  # one replay at a time
        self._tasks: set[asyncio.Task] = set()

    @property
    def is_down(self) -> bool:
        return bool(self._store_to_next_probe)

    async def call(self, stores: Stores, operation: Callable[[], Awaitable[T]]) -> T:
        """operation() unless one of `stores` is down and not due for a probe; LimitsUnavailable if it
        fails (then all of them are down) or is skipped."""
        names = store_names(stores)
        down = [name for name in names if name in self._store_to_next_probe]
        if down:
            now = time.monotonic()
            if any(now < self._store_to_next_probe[name] for name in down):
                raise LimitsUnavailable(f"{' and '.join(down)} store down")
            for name in down:
                self._store_to_next_probe[name] = now + self.probe_interval_s  # this call probes; the others wait
        try:
            result = await operation()
        except LimitsUnavailable as exc:
            for name in names:
                self._failed(name, exc)
            raise
        for name in down:
            self._recovered(name)
        return result

    def by_policy(self) -> None:
        """A call the stores could not decide: a 503 under `closed`; under `open` it goes on."""
        self.num_calls_by_policy += 1
        if self.on_error == "closed":
            raise ServiceUnavailableError("The limits store is unavailable, so this gateway cannot check this "
                                          "key's limits and budget; retry shortly.",
                                          retry_after=self.probe_interval_s, code="limits_unavailable")

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, held until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, stores: Stores, operation: Callable[[], Awaitable[None]]) -> None:
        """A settlement: done now, or kept for replay if the stores cannot take it."""
        try:
            await self.call(stores, operation)
        except LimitsUnavailable:
            self._unsettled.append((stores, operation))

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks)

    def _failed(self, store: str, exc: LimitsUnavailable) -> None:
        now = time.monotonic()
        self._store_to_next_probe[store] = now + self.probe_interval_s
        if self._outage_started is not None:
            return
        self._outage_started = now
        self.num_calls_by_policy = 0
        self._outage_logged = now - self._last_logged >= LOG_INTERVAL_S
        if self._outage_logged:
            self._last_logged = now
            action = ("admitting calls without its limits and reservations (budgets by the ledger's spend)"
                      if self.on_error == "open" else "refusing calls with 503 limits_unavailable")
            logger.warning("tokenway: limits store unavailable (%s); limits_on_error=%s: %s until it answers",
                           exc, self.on_error, action)

    def _recovered(self, store: str) -> None:
        if self._store_to_next_probe.pop(store, None) is None:
            return  # a probe that overlapped this one answered first
        if self._unsettled and not self._replaying:
            self._replaying = True
            self.spawn(self._replay())
        if self._store_to_next_probe or self._outage_started is None:
            return
        if self._outage_logged:
            verb = "admitted" if self.on_error == "open" else "refused"
            logger.warning("tokenway: limits store answering again after %.1f s; %d calls %s by limits_on_error=%s "
                           "meanwhile", time.monotonic() - self._outage_started, self.num_calls_by_policy, verb,
                           self.on_error)
        self._outage_started = None

    async def _replay(self) -> None:
        """Each kept settlement of a store that answers, oldest first; those of a store still down stay."""
        try:
            for _ in range(len(self._unsettled)):
                if not self._unsettled:
                    return
                stores, operation = self._unsettled.popleft()
                try:
                    if down := [name for name in store_names(stores) if name in self._store_to_next_probe]:
                        raise LimitsUnavailable(f"{' and '.join(down)} store down")
                    await self.call(stores, operation)
                except LimitsUnavailable:
                    self._unsettled.append((stores, operation))
        finally:
            self._replaying = False
