"""A gateway process admits most calls itself, from leases on its keys' limits and budgets held
at their owner: the supervisor's counters (one of --workers N), or a Redis.

    Gatekeeper ─► LeasedLimiter.admit / LeasedBudgets.reserve (a budgeted call on a Redis: LeasedJoint)
                   ├► the key's lease has room: admitted (reserved) here, now
                   ├► else a new lease, one ask for every call waiting on it
                   │   ─► owner.lease: RemoteLimiter / RemoteBudgets, or RedisLimiter / RedisBudgets
                   └► none granted: owner.admit / owner.reserve (on a Redis, both in one script), as before
    the lease's time is up, or it is used up ─► owner.settle_lease: what its calls hold

Without leases every call crosses to the owner (gateway/counters.py, or Redis) and back before
it may run: two wake-ups of two processes, ~0.3 ms on an idle 2-core host (~0.4 ms to a Redis),
and one process that every call goes through. With them a process asks about once a second per
key and store.

Exact as the owner alone is. A limits lease counts at the owner as all of its requests and
tokens, admitted at the last moment a worker may use it (limits.py); a budget lease is a
reservation there of all its nanos (budgets.py). This side never admits more from a lease than
it holds, nor after its time (measured from before it asked). A call's reserved tokens come back
to its lease when it ends, as they come back to the key's window at the owner; its cost is
spent from its budget lease. What it costs: what a process has not used of a lease is kept from
the others' calls until the lease ends (at most 1/LEASE_PART of each limit and of the budget,
for at most LEASE_S, per process and key), so a key close to a limit may be refused a little
early; the x-ratelimit-* headers of a call admitted from a lease count the key's window as the
grant found it, plus this process's calls since; and a process that dies takes with it the cost
of its calls since its lease's last settlement (the ledger still has their rows).

Asked call by call, as before: a call in a batch share, a key with a concurrency limit (its
slots are held at the owner), a call larger than the key's leases, a key's first budgeted call
in this process (the owner seeds the key's spend from the ledger then), and for LEASE_S a key the
owner grants no lease (a limit under LEASE_PART, too little of it left). A key with no limits at
all is admitted here, with nothing to ask or settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tokenway.gateway.budgets import (
    BudgetDecision,
    BudgetLease,
    BudgetOwner,
    BudgetReservation,
    BudgetState,
    JointDecision,
    JointStore,
    check_amounts,
)
from tokenway.gateway.limits import (
    LEASE_S,
    Decision,
    Lease,
    LeaseOwner,
    Limiter,
    LimitSpec,
    LimitsUnavailable,
    Reservation,
    WindowState,
    rate_headers,
)
from tokenway.ids import random_hex

logger = logging.getLogger(__name__)

FIRST_CALLS = 8  # a key's first lease holds this many calls; then twice what the last one's calls used
MOST_CALLS = 1 << 16
ASKS_PER_CALL = 32  # a call the leases of a burst did not hold in as many: asked for itself
SETTLE_EVERY_S = 0.05  # an ended lease's settlements, gathered
SETTLE_AGAIN_S = 1.0  # ... and sent again after this while the owner cannot be reached
BUDGET_EPOCH = "lease"  # a BudgetReservation reserved from a lease


@dataclass(slots=True, eq=False, kw_only=True)
class _Held:
    """A lease at the worker: what its calls hold of it."""

    deadline: float  # time.monotonic(): no call is admitted from it after
    num_calls: int = 0  # admitted from it
    ended: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False, kw_only=True)
class _HeldLimits(_Held):
    lease: Lease
    spec: LimitSpec
    num_tokens: int = 0  # reserved by its calls in flight, used by those done

    def admits(self, spec: LimitSpec, reserve_tokens: int, now: float) -> bool:
        return (not self.ended and now < self.deadline and spec == self.spec
                and self.num_calls < self.lease.num_requests
                and self.num_tokens + reserve_tokens <= self.lease.num_tokens)


@dataclass(slots=True, eq=False, kw_only=True)
class _HeldBudget(_Held):
    lease: BudgetLease
    budget_nanos: int
    held_nanos: int = 0  # the worst cases of its calls in flight
    spent_nanos: int = 0  # what its calls that are done cost
    unreported_nanos: int = 0  # of that, what the owner has not heard yet

    def admits(self, budget_nanos: int, worst_nanos: int, now: float) -> bool:
        return (not self.ended and now < self.deadline and budget_nanos == self.budget_nanos
                and self.spent_nanos + self.held_nanos + worst_nanos <= self.lease.nanos)


H = TypeVar("H", bound=_Held)


def _retrieve(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()


@dataclass(slots=True)
class _Key(Generic[H]):
    current: H | None = None
    asking: asyncio.Future[None] | None = None
    per_call_until: float = 0.0  # no lease granted: asked call by call until then
    want_calls: int = FIRST_CALLS
    mean_ask: float = 0.0  # what a call reserves (tokens, nanos), on average
    num_waiting: int = 0  # calls waiting on `asking`


class _Leases(Generic[H]):
    """What both stores' leases share: one lease at a time per key, asked once for a burst,
    ended when used up or out of time, settled in gathered steps."""

    def __init__(self) -> None:
        self._keys: dict[str, _Key[H]] = {}
        self._rid_to_held: dict[str, H | None] = {}  # None: a call with nothing to settle
        self._unsettled: dict[int, H] = {}  # ended leases whose figures the owner has not heard yet
        self._settling: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    async def _from_lease(self, key_id: str, amount: int, admits: Callable[[H, float], bool],
                          ask: Callable[[int, int], Awaitable[Any]], held_of: Callable[[Any, float], H]
                          ) -> H | None:
        """The key's lease once it admits this call (admits(held, now)), asking the owner for a
        new one where it must: ask(calls, amount for them all) is the owner's lease (or None),
        held_of(lease, deadline) this side's. None: the call is asked of the owner for itself.
        amount: what the call reserves (tokens, nanos)."""
        key = self._keys.get(key_id)
        if key is None:
            key = self._keys[key_id] = _Key(mean_ask=amount)
        key.mean_ask += (amount - key.mean_ask) / 8
        for _ in range(ASKS_PER_CALL + 1):
            now = time.monotonic()
            held = key.current
            if held is not None:
                if admits(held, now):
                    held.num_calls += 1
                    return held
                self._end(key, held)  # used up, out of time, or the key's limits changed
            if now < key.per_call_until or (held is not None and self._too_large(held, amount)):
                break  # no lease, or a call larger than the leases the key is granted
            # A burst waits on one ask; the calls its lease did not hold ask again, for more.
            if key.asking is None:
                key.asking = asyncio.ensure_future(self._ask(key, amount, ask, held_of))
                key.asking.add_done_callback(_retrieve)  # read, even where every caller has left
            key.num_waiting += 1
            try:
                await asyncio.shield(key.asking)  # a caller that leaves does not stop the others' ask
            finally:
                key.num_waiting -= 1
        return None

    async def _ask(self, key: _Key[H], amount: int, ask: Callable[[int, int], Awaitable[Any]],
                   held_of: Callable[[Any, float], H]) -> None:
        asked_at = time.monotonic()
        calls = min(MOST_CALLS, max(key.want_calls, key.num_waiting))
        try:
            # An owner that cannot answer is unavailable to every call waiting on the ask: each
            # goes by the gateway's policy, without waiting out the owner once more for itself.
            lease = await ask(calls, max(amount, math.ceil(calls * max(key.mean_ask, amount))))
        finally:
            key.asking = None
        if lease is None:
            key.per_call_until = asked_at + LEASE_S
            return
        if key.current is not None:
            self._end(key, key.current)
        held = key.current = held_of(lease, asked_at + lease.valid_for_s)  # its time counts from the ask
        held.timer = asyncio.get_running_loop().call_later(max(0.0, held.deadline - time.monotonic()),
                                                           self._expire, key, held)

    def _expire(self, key: _Key[H], held: H) -> None:
        held.timer = None
        self._end(key, held)

    def _end(self, key: _Key[H], held: H) -> None:
        """No more calls from this lease; the owner hears what its calls hold."""
        if held.ended:
            return
        held.ended = True
        if key.current is held:
            key.current = None
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        key.want_calls = min(MOST_CALLS, max(FIRST_CALLS, 2 * held.num_calls))
        self._unsettle(held)

    def _unsettle(self, held: H, after_s: float = SETTLE_EVERY_S) -> None:
        self._unsettled[id(held)] = held
        if self._settling is None:
            self._settling = asyncio.get_running_loop().call_later(after_s, self._settle_soon)

    def _settle_soon(self) -> None:
        self._settling = None
        task = asyncio.ensure_future(self._settle())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self) -> None:
        unsettled, self._unsettled = self._unsettled, {}
        for held in unsettled.values():
            try:
                await self._report(held)
            except LimitsUnavailable as exc:
                # Sent again later; meanwhile the owner counts the lease in full (a budget's
                # hold until it expires): nothing is over-admitted.
                logger.debug("a lease's settlement was not sent: %s", exc)
                self._unsettle(held, SETTLE_AGAIN_S)

    def _settle_here(self, reservation_id: str, name: str, used: int, settle: Callable[[H], None]) -> bool:
        """A call admitted here settles (settle(its lease)) now; False for one the owner holds."""
        if used < 0:
            raise ValueError(f"{name} must be >= 0, got {used}")
        if reservation_id not in self._rid_to_held:
            return False
        held = self._rid_to_held.pop(reservation_id)
        if held is not None:  # None: a call with nothing to settle
            settle(held)
            if held.ended:
                self._unsettle(held)
        return True

    def _too_large(self, held: H, amount: int) -> bool:
        raise NotImplementedError

    async def _report(self, held: H) -> None:
        raise NotImplementedError

    async def _close_leases(self) -> None:
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
        if self._settling is not None:  # the owner could not hear the last: nothing to send it again to
            self._settling.cancel()
            self._settling = None


class LeasedLimiter(_Leases[_HeldLimits]):
    """limits.Limiter for a gateway process: calls admitted from leases where it can, the rest
    asked of the owner through `remote`."""

    def __init__(self, remote: LeaseOwner) -> None:
        super().__init__()
        self.remote = remote

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
        held = await self._from_lease(
            key_id, reserve_tokens, lambda held, now: held.admits(spec, reserve_tokens, now),
            lambda calls, tokens: self.remote.lease(key_id, spec, calls, tokens, reserve_tokens),
            lambda lease, deadline: _HeldLimits(lease=lease, spec=spec, deadline=deadline))
        if held is None:
            return await self.remote.admit(key_id, spec, reserve_tokens)
        held.num_tokens += reserve_tokens
        reservation = Reservation(key_id, random_hex(), reserve_tokens, time.monotonic())
        self._rid_to_held[reservation.reservation_id] = held
        lease = held.lease
        num_tokens = lease.num_window_tokens + held.num_tokens
        state = WindowState(lease.num_window_requests + held.num_calls, lease.window_us, num_tokens,
                            lease.window_us if num_tokens > 0 else 0)
        return Decision(True, reservation, None, None, rate_headers(spec, state))

    def _too_large(self, held: _HeldLimits, amount: int) -> bool:
        return held.lease.num_tokens < amount

    async def _report(self, held: _HeldLimits) -> None:
        await self.remote.settle_lease(held.lease, held.num_calls, max(0, held.num_tokens))

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        if not self.reconcile_in_line(reservation, used_tokens):
            await self.remote.reconcile(reservation, used_tokens)

    def reconcile_in_line(self, reservation: Reservation, used_tokens: int) -> bool:
        """Reconciles a call admitted here (from a lease, or with no limits) now; False for one
        the owner admitted, which reconcile() sends it."""
        def settle(held: _HeldLimits) -> None:
            held.num_tokens += used_tokens - reservation.reserved_tokens

        return self._settle_here(reservation.reservation_id, "used_tokens", used_tokens, settle)

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        return await self.remote.headers(key_id, spec)

    async def close(self) -> None:
        await self._close_leases()
        await self.remote.close()


class LeasedBudgets(_Leases[_HeldBudget]):
    """budgets.BudgetStore for a gateway process: calls' worst cases reserved from budget leases
    where it can, the rest asked of the owner through `remote`."""

    def __init__(self, remote: BudgetOwner) -> None:
        super().__init__()
        self.remote = remote

    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int,
                      share_nanos: int | None = None) -> BudgetDecision:
        if share_nanos is not None:
            return await self.remote.reserve(key_id, budget_nanos, worst_nanos, share_nanos)
        decision = await self.reserve_leased(key_id, budget_nanos, worst_nanos)
        return decision if decision is not None else await self.remote.reserve(key_id, budget_nanos, worst_nanos)

    async def reserve_leased(self, key_id: str, budget_nanos: int, worst_nanos: int) -> BudgetDecision | None:
        """The call reserved from the key's lease; None where it must be asked of the owner: a
        key's first call here (the owner seeds the key's spend from the ledger then), or one no
        lease holds (the owner also decides a refusal)."""
        check_amounts(budget_nanos, worst_nanos)
        if key_id not in self._keys:
            self._keys[key_id] = _Key(mean_ask=worst_nanos)
            return None
        held = await self._from_lease(
            key_id, worst_nanos, lambda held, now: held.admits(budget_nanos, worst_nanos, now),
            lambda _, nanos: self.remote.lease(key_id, budget_nanos, nanos, worst_nanos),
            lambda lease, deadline: _HeldBudget(lease=lease, budget_nanos=budget_nanos, deadline=deadline))
        if held is None:
            return None
        decision = BudgetDecision(BudgetReservation(key_id, random_hex(), worst_nanos, BUDGET_EPOCH),
                                  held.lease.spent_nanos + held.spent_nanos, held.lease.held_nanos + held.held_nanos)
        held.held_nanos += worst_nanos
        assert decision.reservation is not None
        self._rid_to_held[decision.reservation.reservation_id] = held
        return decision

    def _too_large(self, held: _HeldBudget, amount: int) -> bool:
        return held.lease.nanos < amount

    async def _report(self, held: _HeldBudget) -> None:
        lease, cost = held.lease, held.unreported_nanos
        await self.remote.settle_lease(lease, cost, held.held_nanos)
        held.unreported_nanos -= cost  # what calls ended during the send stays for the next step

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        if not self.settle_in_line(reservation, used_nanos):
            await self.remote.settle(reservation, used_nanos)

    def settle_in_line(self, reservation: BudgetReservation, used_nanos: int) -> bool:
        """Settles a call reserved from a lease now; False for one the owner reserved, which
        settle() sends it."""
        def settle(held: _HeldBudget) -> None:
            held.held_nanos -= reservation.reserved_nanos
            held.spent_nanos += used_nanos
            held.unreported_nanos += used_nanos

        return self._settle_here(reservation.reservation_id, "used_nanos", used_nanos, settle)

    async def state(self, key_id: str, share: bool = False) -> BudgetState | None:
        return await self.remote.state(key_id, share)

    def joint_with(self, limiter: Limiter) -> JointStore | None:
        """Where the owner has a joint store with `limiter` or the owner of its leases (a Redis
        both share): the call from both stores' leases where they hold it, else that store's one step."""
        joint = self.remote.joint_with(limiter.remote if isinstance(limiter, LeasedLimiter) else limiter)
        return None if joint is None else LeasedJoint(self, limiter, joint)

    async def close(self) -> None:
        await self._close_leases()
        await self.remote.close()


class LeasedJoint:
    """budgets.JointStore over leases: a budgeted call's budget reserved from the key's budget
    lease and its limits from its limits lease, in line, where the leases hold it; otherwise (a
    batch line, a key's first call here, no budget lease) both in the owner's one step, `joint`,
    as without leases. Held by both or by neither all the same: a call the limits refuse gives
    its budget back to the lease at once."""

    def __init__(self, budgets: LeasedBudgets, limiter: Limiter, joint: JointStore) -> None:
        self.budgets, self.limiter, self.joint = budgets, limiter, joint

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int, budget_nanos: int,
                    worst_nanos: int, share: LimitSpec | None = None,
                    share_nanos: int | None = None) -> JointDecision:
        budget = None
        if share is None and share_nanos is None:
            budget = await self.budgets.reserve_leased(key_id, budget_nanos, worst_nanos)
        if budget is None or budget.reservation is None:
            return await self.joint.admit(key_id, spec, reserve_tokens, budget_nanos, worst_nanos, share,
                                          share_nanos)
        try:
            limits = await self.limiter.admit(key_id, spec, reserve_tokens)  # from its lease where it can
        except BaseException:
            self.budgets.settle_in_line(budget.reservation, 0)
            raise
        if not limits.allowed:
            self.budgets.settle_in_line(budget.reservation, 0)
            budget = BudgetDecision(None, budget.spent_nanos, budget.held_nanos)
        return JointDecision(budget, limits)

    async def settle(self, budget: BudgetReservation, used_nanos: int, reservation: Reservation,
                     used_tokens: int) -> None:
        """Both reservations the owner holds (the gatekeeper settles leased ones in line first)."""
        await self.joint.settle(budget, used_nanos, reservation, used_tokens)
