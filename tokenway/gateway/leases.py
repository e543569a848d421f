"""One of --workers N admits most calls itself, from leases on its keys' limits.

    worker: Gatekeeper ─► LeasedLimiter.admit ─► the key's lease has room: admitted here, now
                                              ├► else a new lease, one ask for every call
                                              │  waiting on it ─► RemoteLimiter.lease ─► owner
                                              └► none granted: RemoteLimiter.admit, as before
            the lease's time is up, or it is used up ─► settle_lease: what its calls hold

Without leases every call crosses to the owner (gateway/counters.py) and back before it may
run: two wake-ups of two processes, ~0.3 ms on an idle 2-core host, and one process that every
call of the host goes through. With them a worker asks about once a second per key.

Exact as the owner alone is: a lease counts at the owner as all of its requests and tokens,
admitted at the last moment a worker may use it (limits.py), and this side never admits more
from it than it holds, nor after its time (measured from before it asked). A call's reserved
tokens come back to its lease when it ends, as they come back to the key's window at the owner.
What it costs: what a worker has not used of its lease is kept from the others' calls until
the lease ends (at most 1/LEASE_PART of each limit, for at most LEASE_S, per worker and key),
so a key close to its limit may be refused a little early; and the x-ratelimit-* headers of a
call admitted from a lease count the key's window as the grant found it, plus this worker's
calls since.

Asked call by call, as before: a call in a batch share, a key with a concurrency limit (its
slots are held at the owner), a key the owner grants no lease (a limit under LEASE_PART, or too
little of it left), for LEASE_S. A key with no limits at all is admitted here, with nothing to
ask or settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

from tokenway.gateway.counters import RemoteLimiter
from tokenway.gateway.limits import (
    LEASE_S,
    Decision,
    Lease,
    LimitSpec,
    LimitsUnavailable,
    Reservation,
    WindowState,
    rate_headers,
)
from tokenway.ids import random_hex

logger = logging.getLogger(__name__)

FIRST_REQUESTS = 8  # a key's first lease; then twice what the last one's calls used
MOST_REQUESTS = 1 << 16
ASKS_PER_CALL = 32  # a call the leases of a burst did not hold in as many: asked for itself
SETTLE_EVERY_S = 0.05  # an ended lease's settlements, gathered


@dataclass(slots=True, eq=False)
class _Held:
    """A lease at the worker, and what its calls hold of it."""

    lease: Lease
    spec: LimitSpec
    deadline: float  # time.monotonic(): no call is admitted from it after
    num_requests: int = 0  # admitted from it
    num_tokens: int = 0  # reserved by its calls in flight, used by those done
    num_open: int = 0  # its calls in flight
    ended: bool = False
    timer: asyncio.TimerHandle | None = None

    def admits(self, spec: LimitSpec, reserve_tokens: int, now: float) -> bool:
        return (not self.ended and now < self.deadline and spec == self.spec
                and self.num_requests < self.lease.num_requests
                and self.num_tokens + reserve_tokens <= self.lease.num_tokens)


@dataclass(slots=True)
class _Key:
    current: _Held | None = None
    asking: asyncio.Future[None] | None = None
    per_call_until: float = 0.0  # no lease granted: asked call by call until then
    want_requests: int = FIRST_REQUESTS
    mean_reserve: float = 0.0  # tokens a call reserves, on average
    num_waiting: int = 0  # calls waiting on `asking`


_ASK_OWNER = object()  # a reservation the owner holds (not from a lease)


class LeasedLimiter:
    """limits.Limiter for one of --workers N: calls admitted from leases where it can, the rest
    asked of the owner through `remote`."""

    def __init__(self, remote: RemoteLimiter) -> None:
        self.remote = remote
        self._keys: dict[str, _Key] = {}
        self._rid_to_held: dict[str, _Held | None] = {}  # None: a key with no limits
        self._unsettled: dict[int, _Held] = {}  # ended leases whose figures the owner has not heard yet
        self._settling: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                    share: LimitSpec | None = None) -> Decision:
        if share is not None or spec.max_concurrent is not None:
            return await self.remote.admit(key_id, spec, reserve_tokens, share)
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        if spec.is_unlimited:
            reservation = Reservation(key_id, random_hex(), reserve_tokens, time.monotonic())
            self._rid_to_held[reservation.reservation_id] = None
            return Decision(True, reservation, None, None, {})
        key = self._keys.get(key_id)
        if key is None:
            key = self._keys[key_id] = _Key(mean_reserve=reserve_tokens)
        key.mean_reserve += (reserve_tokens - key.mean_reserve) / 8
        for _ in range(ASKS_PER_CALL + 1):
            now = time.monotonic()
            held = key.current
            if held is not None:
                if held.admits(spec, reserve_tokens, now):
                    return self._admit_from(held, key_id, reserve_tokens, now)
                self._end(key, held)  # used up, out of time, or the key's limits changed
            if now < key.per_call_until or (held is not None and held.lease.num_tokens < reserve_tokens):
                break  # no lease, or a call larger than the leases the key is granted
            # A burst waits on one ask; the calls its lease did not hold ask again, for more.
            if key.asking is None:
                key.asking = asyncio.ensure_future(self._ask(key_id, key, spec, reserve_tokens))
            key.num_waiting += 1
            try:
                await asyncio.shield(key.asking)  # a caller that leaves does not stop the others' ask
            finally:
                key.num_waiting -= 1
        return await self.remote.admit(key_id, spec, reserve_tokens)

    def _admit_from(self, held: _Held, key_id: str, reserve_tokens: int, now: float) -> Decision:
        held.num_requests += 1
        held.num_tokens += reserve_tokens
        held.num_open += 1
        reservation = Reservation(key_id, random_hex(), reserve_tokens, now)
        self._rid_to_held[reservation.reservation_id] = held
        lease = held.lease
        num_tokens = lease.num_window_tokens + held.num_tokens
        state = WindowState(lease.num_window_requests + held.num_requests, lease.window_us, num_tokens,
                            lease.window_us if num_tokens > 0 else 0)
        return Decision(True, reservation, None, None, rate_headers(held.spec, state))

    async def _ask(self, key_id: str, key: _Key, spec: LimitSpec, reserve_tokens: int) -> None:
        asked_at = time.monotonic()
        want_requests = min(MOST_REQUESTS, max(key.want_requests, key.num_waiting))
        want_tokens = max(reserve_tokens, math.ceil(want_requests * max(key.mean_reserve, reserve_tokens)))
        try:
            lease = await self.remote.lease(key_id, spec, want_requests, want_tokens, reserve_tokens)
        except LimitsUnavailable:
            return  # the call asks the owner itself, and the guard hears of it from there
        finally:
            key.asking = None
        if lease is None:
            key.per_call_until = asked_at + LEASE_S
            return
        if key.current is not None:
            self._end(key, key.current)
        held = key.current = _Held(lease, spec, asked_at + lease.valid_for_s)
        held.timer = asyncio.get_running_loop().call_later(max(0.0, held.deadline - time.monotonic()),
                                                           self._expire, key, held)

    def _expire(self, key: _Key, held: _Held) -> None:
        held.timer = None
        self._end(key, held)

    def _end(self, key: _Key, held: _Held) -> None:
        """No more calls from this lease; the owner hears what its calls hold."""
        if held.ended:
            return
        held.ended = True
        if key.current is held:
            key.current = None
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        key.want_requests = min(MOST_REQUESTS, max(FIRST_REQUESTS, 2 * held.num_requests))
        self._unsettled[id(held)] = held
        self._schedule_settling()

    def _schedule_settling(self) -> None:
        if self._settling is None:
            self._settling = asyncio.get_running_loop().call_later(SETTLE_EVERY_S, self._settle_soon)

    def _settle_soon(self) -> None:
        self._settling = None
        task = asyncio.ensure_future(self._settle())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self) -> None:
        unsettled, self._unsettled = self._unsettled, {}
        for held in unsettled.values():
            lease = held.lease
            try:
                await self.remote.settle_lease(lease.key_id, lease.lease_id, held.num_requests,
                                               max(0, held.num_tokens))
            except LimitsUnavailable as exc:
                # The lease ends at the owner on its own, counted in full: nothing over-admitted.
                logger.debug("a lease's settlement was not sent: %s", exc)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        if not self.reconcile_in_line(reservation, used_tokens):
            await self.remote.reconcile(reservation, used_tokens)

    def reconcile_in_line(self, reservation: Reservation, used_tokens: int) -> bool:
        """Reconciles a call admitted here (from a lease, or with no limits) now; False for one
        the owner admitted, which reconcile() sends it."""
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        held = self._rid_to_held.pop(reservation.reservation_id, _ASK_OWNER)
        if held is _ASK_OWNER:
            return False
        if held is not None:
            assert isinstance(held, _Held)
            held.num_tokens += used_tokens - reservation.reserved_tokens
            held.num_open -= 1
            if held.ended:
                self._unsettled[id(held)] = held
                self._schedule_settling()
        return True

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        return await self.remote.headers(key_id, spec)

    async def close(self) -> None:
        for key in self._keys.values():
            if key.current is not None:
                self._end(key, key.current)
        if self._settling is not None:
            self._settling.cancel()
            self._settling = None
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        await self._settle()
        await self.remote.close()
