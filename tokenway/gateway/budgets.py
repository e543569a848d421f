"""Per-key budgets by reservation, as limits.py does tokens.

    reserve(key_id, budget_nanos, worst_nanos) ─► BudgetDecision: a BudgetReservation, or a refusal
        ... the call runs ...
    settle(reservation, used_nanos) ─► the reservation becomes the call's actual cost, in one step

A call reserves its worst case (gatekeeper.py: the prompt and every choice's max_tokens at the
model's price, cached tokens priced as uncached) and settles to what its ledger row bills; a
call refused after it was admitted settles to 0. Amounts are integer nano-dollars, so sums
are exact: a cost rounds up (nanos_up), a budget down (nanos_down). Both backends keep, per key:

  spent   the settled spend: seeded from the ledger (Ledger.spend_usd, committed rows plus
          this process's rows not yet committed) the first time the store sees the key, then
          plus every settled cost, here, so a cost is counted from its settlement on and
          never waits for its ledger commit
  held    the sum of the reservations in flight, each expiring reservation_ttl_s after it was
          made (a gateway that died gives its holds back; its settle then adds the cost alone)

reserve admits iff spent + held + worst <= budget and spent < budget (a key that has used it
all is refused even a free call), atomically (no await between reading and writing here; one
Lua script in Redis, budgets_redis.py), so for every key, while each call costs no more than
it reserved: spent + held <= budget, and the ledger's total <= spent.
A call's worst case exceeds its cost only for a model tokenway cannot tokenize (its prompt
is an estimate until the upstream's usage comes back).

Keys that gain a budget while their unbudgeted calls run: those calls reserved nothing and
settle nothing here; the seed counts them only if their rows are in the ledger by then.

A key's batch share (gateway/shares.py) is a second spent and held beside the key's, seeded
from what the ledger says its batch lines cost (share_seed): a call reserved with share_nanos
must fit both, is held in both (or neither) in the same atomic step, and settles in both.

A lease (InProcessBudgets.lease_now; gateway/leases.py) is a reservation held for one of
--workers N, which reserves its calls' worst cases from it on its own: the worker settles it
in steps (settle_lease_now), each adding what its calls have cost since to spent and leaving
held what its calls in flight still reserve, so spent + held never counts less than here.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenway.gateway.limits import LEASE_PART, LEASE_S, Decision, Limiter, LimitSpec, Reservation, limits_backend

NANOS_PER_USD = 10**9
# Lua's numbers are doubles: integers are exact up to 2**53 nanos (about $9 million); a budget
# above that is as good as none.
MAX_NANOS = 2**53 - 1

# The ledger's view of a key's spend in USD, for the seed (Ledger.spend_usd).
SpendSeed = Callable[[str], Awaitable[float]]


def nanos_up(usd: float) -> int:
    """A cost in nanos, rounded up (after dropping float noise: 0.0015 * 1e9 is 1499999.9999999998)."""
    if not math.isfinite(usd) or usd < 0:
        raise ValueError(f"an amount must be finite and >= 0, got {usd!r}")
    return min(MAX_NANOS, math.ceil(round(usd * NANOS_PER_USD, 3)))


def nanos_down(usd: float) -> int:
    """A budget in nanos, rounded down: the budget is never exceeded by a rounding."""
    if not math.isfinite(usd) or usd < 0:
        raise ValueError(f"an amount must be finite and >= 0, got {usd!r}")
    return min(MAX_NANOS, math.floor(round(usd * NANOS_PER_USD, 3)))


def format_usd(nanos: int) -> str:
    """$0.50, $0.034, $0.000123: cents always, more digits only where they say something."""
    text = f"{nanos / NANOS_PER_USD:,.6f}".rstrip("0")
    whole, _, cents = text.partition(".")
    return f"${whole}.{cents.ljust(2, '0')}"


@dataclass(frozen=True, slots=True)
class BudgetReservation:
    """What reserve() holds for one call until settle()."""

    key_id: str
    reservation_id: str
    reserved_nanos: int
    # The key's state it was made in: Redis re-seeds a key whose state it lost under a new
    # epoch, and a settle for the old one is dropped (the seed read the ledger, which has the call).
    epoch: str
    share_epoch: str | None = None  # the key's batch share's, for a call held there too; None: not


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    reservation: BudgetReservation | None  # None: refused
    spent_nanos: int  # the key's settled spend when decided (its share's, where the share refused)
    held_nanos: int  # the other calls' reservations in flight when decided (likewise)
    by_share: bool = False  # refused by the key's batch share, not by its whole budget

    @property
    def allowed(self) -> bool:
        return self.reservation is not None


@dataclass(frozen=True, slots=True)
class BudgetLease:
    """A part of one key's budget, held for one worker (lease_now): it may reserve its calls'
    worst cases from it on its own, up to `nanos` together, for `valid_for_s` from before it asked."""

    key_id: str
    reservation_id: str
    nanos: int
    valid_for_s: float
    spent_nanos: int  # the key's, as the grant found them, the lease not counted
    held_nanos: int
    # The owner's epoch of the key's state at the grant (budgets_redis.py): a settlement step for a
    # state seeded anew since is dropped, as a call's settle is.
    epoch: str = ""


@dataclass(frozen=True, slots=True)
class BudgetState:
    spent_nanos: int
    held_nanos: int


class BudgetStore(Protocol):
    """Every method may raise LimitsUnavailable (the store cannot answer); reserve also
    SeedUnavailable (the ledger cannot seed a key the store has not seen)."""

    # share_nanos: the key's batch share of its budget, which the call must fit too (a batch line).
    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int,
                      share_nanos: int | None = None) -> BudgetDecision: ...

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        """Replace the reservation by the call's cost (in its share too); at most once per reservation."""

    async def state(self, key_id: str, share: bool = False) -> BudgetState | None:
        """The key's spend and holds (its batch share's); None for a key the store has not seeded."""

    def joint_with(self, limiter: Limiter) -> JointStore | None:
        """This store and `limiter` as one JointStore where they can be; None: they are asked in turn."""

    async def close(self) -> None: ...


class BudgetOwner(BudgetStore, Protocol):
    """A budget store that also grants leases (gateway/leases.py LeasedBudgets reserves from them):
    the supervisor's counters for --workers N (counters.py RemoteBudgets), or a Redis
    (budgets_redis.py)."""

    async def lease(self, key_id: str, budget_nanos: int, want_nanos: int, min_nanos: int) -> BudgetLease | None: ...

    async def settle_lease(self, lease: BudgetLease, cost_nanos: int, held_nanos: int) -> None:
        """One step: cost_nanos its calls have cost since the last are spent, its hold becomes held_nanos."""


@dataclass(frozen=True, slots=True)
class JointDecision:
    """A budgeted call decided by its budget and its limits at once: held by both, or by neither."""

    budget: BudgetDecision  # its reservation: the call's, when the limits admit it too (else None)
    limits: Decision | None  # None: the budget refused, and the limits were not asked


class JointStore(Protocol):
    """A budget store and a limiter as one (joint_redis.py: one script on the Redis they share),
    so that a budgeted call is admitted in one step and settled in one, rather than in turn.
    The budget is asked first: where both would refuse, the call hears the budget's refusal.
    Raises as both stores do (LimitsUnavailable, SeedUnavailable)."""

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int, budget_nanos: int,
                    worst_nanos: int, share: LimitSpec | None = None,
                    share_nanos: int | None = None) -> JointDecision: ...

    async def settle(self, budget: BudgetReservation, used_nanos: int, reservation: Reservation,
                     used_tokens: int) -> None:
        """BudgetStore.settle and Limiter.reconcile, of one call's two reservations."""


def check_amounts(budget_nanos: int, worst_nanos: int) -> None:
    if budget_nanos < 0 or worst_nanos < 0:
        raise ValueError(f"budget and worst case must be >= 0 nanos, got {budget_nanos}, {worst_nanos}")


class SeedUnavailable(Exception):
    """The ledger cannot give a key's spend to seed it (its database is down, it is closed).
    Not the store's fault: the gateway follows limits_on_error for this call alone, and the
    ledger logs its own outage."""


class SeedReader:
    """The ledger's spend of a key in nanos, read once however many calls ask at the same time
    (a cold key's burst is one ledger read); SeedUnavailable when the ledger cannot say."""

    def __init__(self, seed: SpendSeed) -> None:
        self._seed = seed
        self._key_to_read: dict[str, asyncio.Future[int]] = {}

    async def read(self, key_id: str) -> int:
        read = self._key_to_read.get(key_id)
        if read is None:
            read = self._key_to_read[key_id] = asyncio.ensure_future(self._read(key_id))
            read.add_done_callback(lambda _: self._key_to_read.pop(key_id, None))
        return await asyncio.shield(read)  # a caller cancelled does not cancel the others' read

    async def _read(self, key_id: str) -> int:
        try:
            return nanos_up(await self._seed(key_id))
        except Exception as exc:  # noqa: BLE001 - whatever the ledger's failure, the call goes by the policy
            raise SeedUnavailable(f"the ledger cannot seed {key_id}'s spend: {type(exc).__name__}: {exc}") from None


@dataclass(slots=True)
class _KeyBudget:
    spent_nanos: int
    held_nanos: int = 0
    rid_to_nanos: dict[str, int] = field(default_factory=dict)  # in flight
    # (expires_us, reservation_id) in reservation order; settled ones are skipped lazily.
    expiry_order: deque[tuple[int, str]] = field(default_factory=deque)


def fits(budget_nanos: int, worst_nanos: int, spent_nanos: int, held_nanos: int) -> bool:
    """A key that has used it all is refused even a free call."""
    return spent_nanos + held_nanos + worst_nanos <= budget_nanos and spent_nanos < budget_nanos


class InProcessBudgets:
    """The embedded backend: one _KeyBudget per key, and one per key's batch share. Atomic within
    one event loop because no method awaits between reading and writing a key's state (not
    thread-safe). Gateways that do not share Redis each count their own spend on top of their
    own seed. share_seed: what a key's batch lines have cost, to seed its share (None: the
    store takes no share)."""

    EPOCH = "local"

    def __init__(self, seed: SpendSeed, *, share_seed: SpendSeed | None = None,
                 reservation_ttl_s: float = 600.0) -> None:
        if reservation_ttl_s <= 0:
            raise ValueError("reservation_ttl_s must be positive")
        self._seeds = SeedReader(seed)
        self._share_seeds = SeedReader(share_seed) if share_seed is not None else None
        self._ttl_us = round(reservation_ttl_s * 1e6)
        self._key_to_state: dict[str, _KeyBudget] = {}
        self._key_to_share: dict[str, _KeyBudget] = {}
        self._reservation_ids = itertools.count()

    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int,
                      share_nanos: int | None = None) -> BudgetDecision:
        decision = self.reserve_now(key_id, budget_nanos, worst_nanos, share_nanos)  # checks the amounts too
        if decision is None:  # the key (or its share) not seeded yet: read the seeds, then decide
            await self._open(self._key_to_state, self._seeds, key_id)
            if share_nanos is not None:
                assert self._share_seeds is not None, "reserve_now refuses a share without a share_seed"
                await self._open(self._key_to_share, self._share_seeds, key_id)
            decision = self.reserve_now(key_id, budget_nanos, worst_nanos, share_nanos)
            assert decision is not None, "both states were opened above, and nothing drops one"
        return decision

    # The *_now methods are the same calls without a coroutine, for an owner that answers them
    # in line as they are read (gateway/counters.py).

    def reserve_now(self, key_id: str, budget_nanos: int, worst_nanos: int,
                    share_nanos: int | None = None) -> BudgetDecision | None:
        """reserve() for a key whose state (and share's) is open; None where a seed must be read
        first (then call reserve)."""
        check_amounts(budget_nanos, worst_nanos)
        state = self._key_to_state.get(key_id)
        share = None
        if share_nanos is not None:
            check_amounts(share_nanos, worst_nanos)
            if self._share_seeds is None:
                raise ValueError("a batch share needs a store made with a share_seed")
            share = self._key_to_share.get(key_id)
            if share is None:
                return None
        if state is None:
            return None
        # The decision and the holds are one step.
        now = time.monotonic_ns() // 1000
        self._prune(state, now)
        if not fits(budget_nanos, worst_nanos, state.spent_nanos, state.held_nanos):
            return BudgetDecision(None, state.spent_nanos, state.held_nanos)
        if share is not None:
            assert share_nanos is not None
            self._prune(share, now)
            if not fits(share_nanos, worst_nanos, share.spent_nanos, share.held_nanos):
                return BudgetDecision(None, share.spent_nanos, share.held_nanos, by_share=True)
        reservation = BudgetReservation(key_id, str(next(self._reservation_ids)), worst_nanos, self.EPOCH,
                                        self.EPOCH if share is not None else None)
        decision = BudgetDecision(reservation, state.spent_nanos, state.held_nanos)
        for held in (state, share):
            if held is not None:
                held.rid_to_nanos[reservation.reservation_id] = worst_nanos
                held.held_nanos += worst_nanos
                held.expiry_order.append((now + self._ttl_us, reservation.reservation_id))
        return decision

    async def lease(self, key_id: str, budget_nanos: int, want_nanos: int, min_nanos: int) -> BudgetLease | None:
        return self.lease_now(key_id, budget_nanos, want_nanos, min_nanos)

    async def settle_lease(self, lease: BudgetLease, cost_nanos: int, held_nanos: int) -> None:
        self.settle_lease_now(lease.key_id, lease.reservation_id, cost_nanos, held_nanos)

    def lease_now(self, key_id: str, budget_nanos: int, want_nanos: int, min_nanos: int) -> BudgetLease | None:
        """Up to want_nanos of the key's budget, held for one worker for LEASE_S: at most
        1/LEASE_PART of the budget, and only what is free now. None where less than min_nanos
        would be granted, and for a key not seeded yet (its first call is reserved for itself)."""
        check_lease_amounts(budget_nanos, want_nanos, min_nanos)
        state = self._key_to_state.get(key_id)
        if state is None:
            return None
        now = time.monotonic_ns() // 1000
        self._prune(state, now)
        spent, held = state.spent_nanos, state.held_nanos
        nanos = min(want_nanos, budget_nanos // LEASE_PART, budget_nanos - spent - held)
        if nanos < min_nanos or not fits(budget_nanos, nanos, spent, held):
            return None
        lease = BudgetLease(key_id, str(next(self._reservation_ids)), nanos, LEASE_S, spent, held)
        state.rid_to_nanos[lease.reservation_id] = nanos
        state.held_nanos += nanos
        state.expiry_order.append((now + self._ttl_us, lease.reservation_id))
        return lease

    def settle_lease_now(self, key_id: str, reservation_id: str, cost_nanos: int, held_nanos: int) -> None:
        """One step of a lease's settlement: cost_nanos its calls have cost since the last step
        are spent, and its hold becomes held_nanos (its calls in flight; 0 once they are done)."""
        check_lease_settlement(cost_nanos, held_nanos)
        state = self._key_to_state.get(key_id)
        if state is None:
            return
        self._prune(state, time.monotonic_ns() // 1000)
        state.spent_nanos += cost_nanos  # owed whether or not the hold has expired
        hold = state.rid_to_nanos.get(reservation_id)
        if hold is None:
            return
        state.held_nanos += held_nanos - hold
        if held_nanos:
            state.rid_to_nanos[reservation_id] = held_nanos
        else:
            del state.rid_to_nanos[reservation_id]

    @staticmethod
    async def _open(key_to_state: dict[str, _KeyBudget], seeds: SeedReader, key_id: str) -> _KeyBudget:
        state = key_to_state.get(key_id)
        if state is None:
            spent = await seeds.read(key_id)
            # Another call may have seeded it during the await; its state (and holds) stands.
            state = key_to_state.setdefault(key_id, _KeyBudget(spent))
        return state

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        self.settle_now(reservation, used_nanos)

    def settle_in_line(self, reservation: BudgetReservation, used_nanos: int) -> bool:
        """settle_now, for the gatekeeper's in-line settlement: every call is settled here."""
        self.settle_now(reservation, used_nanos)
        return True

    def settle_now(self, reservation: BudgetReservation, used_nanos: int) -> None:
        if used_nanos < 0:
            raise ValueError(f"used_nanos must be >= 0, got {used_nanos}")
        now = time.monotonic_ns() // 1000
        self._settle(self._key_to_state.get(reservation.key_id), reservation.reservation_id, used_nanos, now)
        if reservation.share_epoch is not None:
            self._settle(self._key_to_share.get(reservation.key_id), reservation.reservation_id, used_nanos, now)

    def _settle(self, state: _KeyBudget | None, reservation_id: str, used_nanos: int, now: int) -> None:
        if state is None:
            return
        self._prune(state, now)
        held = state.rid_to_nanos.pop(reservation_id, None)
        if held is not None:
            state.held_nanos -= held
        # An expired reservation gave its hold back already; the cost is owed all the same.
        state.spent_nanos += used_nanos

    async def state(self, key_id: str, share: bool = False) -> BudgetState | None:
        return self.state_now(key_id, share)

    def state_now(self, key_id: str, share: bool = False) -> BudgetState | None:
        state = (self._key_to_share if share else self._key_to_state).get(key_id)
        if state is None:
            return None
        self._prune(state, time.monotonic_ns() // 1000)
        return BudgetState(state.spent_nanos, state.held_nanos)

    def joint_with(self, limiter: Limiter) -> None:
        return None  # nothing to save: no round trip to either store

    async def close(self) -> None:
        self._key_to_state.clear()
        self._key_to_share.clear()

    def _prune(self, state: _KeyBudget, now: int) -> None:
        while state.expiry_order:
            expires_us, reservation_id = state.expiry_order[0]
            if reservation_id in state.rid_to_nanos and expires_us > now:
                break
            state.expiry_order.popleft()
            held = state.rid_to_nanos.pop(reservation_id, None)
            if held is not None:
                state.held_nanos -= held


def check_lease_amounts(budget_nanos: int, want_nanos: int, min_nanos: int) -> None:
    check_amounts(budget_nanos, want_nanos)
    if not 0 <= min_nanos <= want_nanos:
        raise ValueError(f"a lease of {want_nanos} nanos, at least {min_nanos}")


def check_lease_settlement(cost_nanos: int, held_nanos: int) -> None:
    if cost_nanos < 0 or held_nanos < 0:
        raise ValueError(f"a lease settles {cost_nanos} nanos spent, {held_nanos} held")


def make_budgets(url: str | None, seed: SpendSeed, share_seed: SpendSeed | None = None) -> BudgetStore:
    """The budget store beside the limits: in process for "memory", else the same Redis, which
    this process reserves most calls from leases on (leases.py)."""
    if limits_backend(url) == "memory":
        return InProcessBudgets(seed, share_seed=share_seed)
    assert url is not None  # None is "memory"
    from tokenway.gateway.budgets_redis import RedisBudgets  # redis is only needed for this backend
    from tokenway.gateway.leases import LeasedBudgets

    return LeasedBudgets(RedisBudgets(url, seed, share_seed=share_seed))
