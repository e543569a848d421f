"""Per-key limits by reservation: requests and tokens per minute, tokens per day, concurrency.

    admit(key_id, spec, reserve_tokens) ─► Decision: a Reservation, or a refusal with retry_after_s
        ... the request runs ...
    reconcile(reservation, used_tokens) ─► the reserved tokens become the used ones; the slot is freed

Both backends keep the same state per key, in integer microseconds of their own clock
(time.monotonic here, Redis's TIME in limits_redis):
  window     every request admitted in the last window_s, as (t_us, num_tokens): reserved tokens
             until reconciled, used tokens after. RPM counts its entries, TPM sums their tokens.
             A request's tokens count at the time it was admitted.
  day        tokens per bucket of day_s / 1440 (a minute by default); TPD sums the live buckets.
  in flight  reservations not yet reconciled, each expiring reservation_ttl_s after admission so
             that the slots of a gateway that died come back.
admit checks every limit and records the request only if all pass, in one atomic step (no await
in between here; one Lua script in Redis). So, for every key at all times, while used <= reserved:
    len(window) <= rpm,  sum(window tokens) <= tpm,  sum(day tokens) <= tpd,  len(in flight) <= max_concurrent.

A key's batch share (gateway/shares.py) is a second such state beside the key's own: a call
admitted with `share` (a batch line) is checked against both and recorded in both, or in
neither, in the same atomic step, and reconciled in both. So its class never holds more than
the share's limits, and the key's other calls always find the rest of its own.

A lease (InProcessLimiter.lease_now; gateway/leases.py) is a slice of a key's window held for
one of --workers N, which admits calls from it on its own until the lease's time is up: it
counts as `num_requests` requests and `num_tokens` tokens admitted at the last moment it may
be used (granted + lease_s), so every call admitted from it is counted at least as long as if
it had been admitted here, and the invariants above still hold. When its time is up the worker
settles it to what its calls used (settle_lease_now), and the rest is free again.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from tokenway.ids import random_hex

NUM_DAY_BUCKETS = 1440
MAX_RETRY_AFTER_S = 120.0
# A lease lasts this long, and holds at most this part of any of its key's limits: what the
# workers' leases keep from each other's calls while they last is bounded by both.
LEASE_S = 1.0
LEASE_PART = 16
# A slot frees when some request ends, which can't be foreseen: this is a hint, not a promise.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """One key's limits; None is unlimited."""

    rpm: int | None = None  # requests per sliding window (60 s)
    tpm: int | None = None  # tokens per sliding window (60 s)
    tpd: int | None = None  # tokens per sliding day, in NUM_DAY_BUCKETS buckets
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "tpd", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    @property
    def is_unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.tpd is None and self.max_concurrent is None


@dataclass(slots=True)
class Reservation:
    """What admit() holds for one request until reconcile()."""

    key_id: str
    reservation_id: str
    reserved_tokens: int
    admitted_at: float  # seconds on the backend's clock
    in_share: bool = False  # held in the key's batch share too: reconciled there as well


@dataclass(slots=True)
class Decision:
    allowed: bool
    reservation: Reservation | None  # when allowed
    limit_kind: str | None  # when refused: "requests" | "tokens" | "tokens_per_day" | "concurrency"
    # When refused: the time until this request would be admitted, capped at MAX_RETRY_AFTER_S;
    # None when the request is larger than the limit itself, so that no wait would help.
    retry_after_s: float | None
    headers: dict[str, str]
    by_share: bool = False  # when refused: the key's batch share refused it, not the key's own limits


@dataclass(frozen=True, slots=True)
class Lease:
    """A slice of one key's limits, granted to one worker (lease_now): it may admit calls from it
    on its own, up to `num_requests` of them holding at most `num_tokens` tokens together, for
    `valid_for_s` from before it asked."""

    key_id: str
    lease_id: str
    num_requests: int
    num_tokens: int
    valid_for_s: float
    window_us: int
    # The key's window as the grant found it, the lease not counted: the worker's headers start from it.
    num_window_requests: int
    num_window_tokens: int


class LimitsUnavailable(Exception):
    """A shared store (the limiter's or the budgets', budgets.py) cannot answer: unreachable,
    timed out, refusing writes. The gateway then follows its limits_on_error policy
    (gateway/outage.py); anything else a backend raises is a bug."""


class Limiter(Protocol):
    """Every method may raise LimitsUnavailable, and nothing else for a store that is down."""

    # share: the limits of the key's batch share, which the call counts against too (a batch line).
    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                    share: LimitSpec | None = None) -> Decision: ...

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None: ...

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]: ...

    async def close(self) -> None: ...


class LeaseOwner(Limiter, Protocol):
    """A limiter that also grants leases (gateway/leases.py LeasedLimiter admits from them): the
    supervisor's counters for --workers N (counters.py RemoteLimiter), or a Redis (limits_redis.py)."""

    async def lease(self, key_id: str, spec: LimitSpec, want_requests: int, want_tokens: int,
                    min_tokens: int) -> Lease | None: ...

    async def settle_lease(self, lease: Lease, num_requests: int, num_tokens: int) -> None:
        """The lease's figures become what its calls used: num_requests, holding num_tokens."""


@dataclass(frozen=True, slots=True)
class Windows:
    """The lengths both backends measure with, in microseconds (exact integer arithmetic)."""

    window_us: int
    bucket_us: int  # one day bucket
    reservation_ttl_us: int

    @classmethod
    def from_seconds(cls, window_s: float, day_s: float, reservation_ttl_s: float) -> Windows:
        if not (window_s > 0 and day_s > 0 and reservation_ttl_s > 0):
            raise ValueError("window_s, day_s and reservation_ttl_s must be positive")
        bucket_us = round(day_s * 1e6) // NUM_DAY_BUCKETS
        if bucket_us < 1:
            raise ValueError(f"day_s must be at least {NUM_DAY_BUCKETS} µs")
        return cls(round(window_s * 1e6), bucket_us, round(reservation_ttl_s * 1e6))


@dataclass(slots=True)
class Refusal:
    limit_kind: str
    wait_us: int | None  # None: larger than the limit itself
    by_share: bool = False


def longest(refusal: Refusal | None, other: Refusal | None) -> Refusal | None:
    """Of two refusals, the one that takes longer to pass (larger than a limit: forever)."""
    if refusal is None or other is None:
        return refusal or other
    if refusal.wait_us is None or (other.wait_us is not None and refusal.wait_us >= other.wait_us):
        return refusal
    return other


@dataclass(slots=True)
class WindowState:
    """What the x-ratelimit-* headers report: the window as it is (after an admission, if any)."""

    num_requests: int
    requests_reset_us: int  # until the newest request leaves the window
    num_tokens: int
    tokens_reset_us: int  # until the newest request holding tokens leaves the window


def check_lease_ask(want_requests: int, want_tokens: int, min_tokens: int) -> None:
    if want_requests < 1 or want_tokens < min_tokens or min_tokens < 0:
        raise ValueError(f"a lease of {want_requests} requests and {want_tokens} tokens (at least {min_tokens})")


def check_lease_settlement(num_requests: int, num_tokens: int) -> None:
    if num_requests < 0 or num_tokens < 0:
        raise ValueError(f"a lease settles to {num_requests} requests and {num_tokens} tokens")


def too_large(spec: LimitSpec, reserve_tokens: int, share: LimitSpec | None = None) -> Refusal | None:
    """A request no wait would admit: larger than the key's TPM or TPD, or its share's."""
    if reserve_tokens < 0:
        raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
    for limits, by_share in ((spec, False), (share, True)):
        if limits is not None and limits.tpm is not None and reserve_tokens > limits.tpm:
            return Refusal("tokens", None, by_share)
        if limits is not None and limits.tpd is not None and reserve_tokens > limits.tpd:
            return Refusal("tokens_per_day", None, by_share)
    return None


def format_reset(duration_us: int) -> str:
    """OpenAI's (Go's) duration format, "20ms", "1.5s", "6m0s", "1h0m0s", rounded up to the ms
    so that the limit has reset by the time it says."""
    ms = -(-max(0, duration_us) // 1000)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds = str(ms // 1000) + (f".{ms % 1000:03d}".rstrip("0") if ms % 1000 else "")
    prefix = f"{hours}h{minutes}m" if hours else f"{minutes}m" if minutes else ""
    return f"{prefix}{seconds}s"


def rate_headers(spec: LimitSpec, state: WindowState) -> dict[str, str]:
    headers: dict[str, str] = {}
    if spec.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(spec.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, spec.rpm - state.num_requests))
        headers["x-ratelimit-reset-requests"] = format_reset(state.requests_reset_us)
    if spec.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(spec.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, spec.tpm - state.num_tokens))
        headers["x-ratelimit-reset-tokens"] = format_reset(state.tokens_reset_us)
    return headers


def make_decision(
    spec: LimitSpec, state: WindowState, reservation: Reservation | None, refusal: Refusal | None
) -> Decision:
    headers = rate_headers(spec, state)
    if refusal is None:
        assert reservation is not None
        return Decision(True, reservation, None, None, headers)
    if refusal.wait_us is None:
        return Decision(False, None, refusal.limit_kind, None, headers, refusal.by_share)
    wait_us = min(refusal.wait_us, round(MAX_RETRY_AFTER_S * 1e6))
    headers["retry-after"] = str(min(int(MAX_RETRY_AFTER_S), max(1, math.ceil(wait_us / 1e6))))
    headers["retry-after-ms"] = str(max(1, -(-wait_us // 1000)))
    return Decision(False, None, refusal.limit_kind, wait_us / 1e6, headers, refusal.by_share)


@dataclass(slots=True)
class _Admission:
    t_us: int
    num_tokens: int  # reserved until reconciled, then used


@dataclass(slots=True)
class _DayBucket:
    index: int  # t_us // bucket_us
    num_tokens: int


@dataclass(slots=True)
class _Held:
    admission: _Admission
    bucket: _DayBucket
    reserved_tokens: int


@dataclass(slots=True)
class _Lease:
    t_us: int  # the last moment a worker may admit from it: it counts as admitted then
    num_tokens: int  # granted until settled, then what its calls used
    num_requests: int
    lease_id: str
    bucket: _DayBucket


@dataclass(slots=True)
class _KeyState:
    window: deque[_Admission] = field(default_factory=deque)  # oldest first
    num_window_tokens: int = 0  # == sum of window's num_tokens
    day: deque[_DayBucket] = field(default_factory=deque)  # oldest first, only live buckets
    num_day_tokens: int = 0  # == sum of day's num_tokens
    rid_to_held: dict[str, _Held] = field(default_factory=dict)  # in flight
    # (expires_us, reservation_id) in admission order; entries already reconciled are skipped lazily.
    expiry_order: deque[tuple[int, str]] = field(default_factory=deque)
    # Leases in the window, oldest first (all last lease_s: in the order granted); their tokens
    # are in num_window_tokens and their day bucket's, their requests here.
    leases: deque[_Lease] = field(default_factory=deque)
    id_to_lease: dict[str, _Lease] = field(default_factory=dict)
    num_lease_requests: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.window) + self.num_lease_requests

    def entries(self) -> Iterator[_Admission | _Lease]:
        """The window's admissions and leases together, oldest first."""
        if not self.leases:
            return iter(self.window)
        return heapq.merge(self.window, self.leases, key=lambda entry: entry.t_us)


class InProcessLimiter:
    """The embedded backend: one _KeyState per key, and one per key's batch share. Atomic within
    one event loop because no method awaits between reading and writing the state (not thread-safe)."""

    def __init__(self, *, window_s: float = 60.0, day_s: float = 86400.0, reservation_ttl_s: float = 600.0,
                 lease_s: float = LEASE_S):
        self.windows = Windows.from_seconds(window_s, day_s, reservation_ttl_s)
        if not lease_s > 0:
            raise ValueError("lease_s must be positive")
        self.lease_s = lease_s
        self._key_to_state: dict[str, _KeyState] = {}
        self._key_to_share: dict[str, _KeyState] = {}

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                    share: LimitSpec | None = None) -> Decision:
        return self.admit_now(key_id, spec, reserve_tokens, share)

    # The *_now methods are the same calls without a coroutine, for an owner that answers them
    # in line as they are read (gateway/counters.py): none of them ever waits.

    def admit_now(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                  share: LimitSpec | None = None) -> Decision:
        refusal = too_large(spec, reserve_tokens, share)
        now = time.monotonic_ns() // 1000
        state = self._key_to_state.setdefault(key_id, _KeyState())
        self._prune(state, now)
        share_state = None
        if share is not None:
            share_state = self._key_to_share.setdefault(key_id, _KeyState())
            self._prune(share_state, now)
        if refusal is None:
            refusal = self._refusal(state, spec, reserve_tokens, now)
            if share is not None and share_state is not None:
                refusal = longest(refusal, self._refusal(share_state, share, reserve_tokens, now, by_share=True))
        if refusal is not None:
            return make_decision(spec, self._window_state(state, now), None, refusal)
        reservation = Reservation(key_id, random_hex(), reserve_tokens, now / 1e6, share is not None)
        self._record(state, reservation, now)
        if share_state is not None:
            self._record(share_state, reservation, now)
        return make_decision(spec, self._window_state(state, now), reservation, None)

    def _record(self, state: _KeyState, reservation: Reservation, now: int) -> None:
        reserve_tokens = reservation.reserved_tokens
        admission = _Admission(now, reserve_tokens)
        state.window.append(admission)
        state.num_window_tokens += reserve_tokens
        bucket = self._day_bucket(state, now, reserve_tokens)
        state.rid_to_held[reservation.reservation_id] = _Held(admission, bucket, reserve_tokens)
        state.expiry_order.append((now + self.windows.reservation_ttl_us, reservation.reservation_id))

    def _day_bucket(self, state: _KeyState, t_us: int, num_tokens: int) -> _DayBucket:
        """Counts num_tokens in the day bucket of t_us, or in the newest if that is later (a
        lease's: counted a little longer, never shorter)."""
        index = t_us // self.windows.bucket_us
        if not state.day or state.day[-1].index < index:
            state.day.append(_DayBucket(index, 0))
        bucket = state.day[-1]
        bucket.num_tokens += num_tokens
        state.num_day_tokens += num_tokens
        return bucket

    def lease_now(self, key_id: str, spec: LimitSpec, want_requests: int, want_tokens: int,
                  min_tokens: int) -> Lease | None:
        """Up to want_requests requests and want_tokens tokens of the key's limits, held for one
        worker for lease_s; at most 1/LEASE_PART of each limit, and only what is free now. None
        where less than one request and min_tokens tokens would be granted, and for a key with a
        concurrency limit (a leased call holds no slot here): that worker asks call by call."""
        check_lease_ask(want_requests, want_tokens, min_tokens)
        if spec.max_concurrent is not None:
            return None
        now = time.monotonic_ns() // 1000
        state = self._key_to_state.setdefault(key_id, _KeyState())
        self._prune(state, now)
        num_requests, num_tokens = want_requests, want_tokens
        if spec.rpm is not None:
            num_requests = min(num_requests, spec.rpm // LEASE_PART, spec.rpm - state.num_requests)
        for limit, used in ((spec.tpm, state.num_window_tokens), (spec.tpd, state.num_day_tokens)):
            if limit is not None:
                num_tokens = min(num_tokens, limit // LEASE_PART, limit - used)
        if num_requests < 1 or num_tokens < min_tokens:
            return None
        lease = Lease(key_id, random_hex(), num_requests, num_tokens, self.lease_s, self.windows.window_us,
                      state.num_requests, state.num_window_tokens)
        t_us = now + round(self.lease_s * 1e6)
        entry = _Lease(t_us, num_tokens, num_requests, lease.lease_id, self._day_bucket(state, t_us, num_tokens))
        state.leases.append(entry)
        state.id_to_lease[lease.lease_id] = entry
        state.num_lease_requests += num_requests
        state.num_window_tokens += num_tokens
        return lease

    async def lease(self, key_id: str, spec: LimitSpec, want_requests: int, want_tokens: int,
                    min_tokens: int) -> Lease | None:
        return self.lease_now(key_id, spec, want_requests, want_tokens, min_tokens)

    async def settle_lease(self, lease: Lease, num_requests: int, num_tokens: int) -> None:
        self.settle_lease_now(lease.key_id, lease.lease_id, num_requests, num_tokens)

    def settle_lease_now(self, key_id: str, lease_id: str, num_requests: int, num_tokens: int) -> None:
        """A lease's figures become what its calls used: num_requests admitted from it, holding
        num_tokens (reserved while in flight, used once done). Sent again as they change."""
        check_lease_settlement(num_requests, num_tokens)
        state = self._key_to_state.get(key_id)
        if state is None:
            return
        now = time.monotonic_ns() // 1000
        self._prune(state, now)
        entry = state.id_to_lease.get(lease_id)
        if entry is None:  # out of the window already
            return
        state.num_lease_requests += num_requests - entry.num_requests
        delta = num_tokens - entry.num_tokens
        state.num_window_tokens += delta
        if entry.bucket.index > now // self.windows.bucket_us - NUM_DAY_BUCKETS:
            state.num_day_tokens += delta
        entry.bucket.num_tokens += delta
        entry.num_requests, entry.num_tokens = num_requests, num_tokens

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        self.reconcile_now(reservation, used_tokens)

    def reconcile_in_line(self, reservation: Reservation, used_tokens: int) -> bool:
        """reconcile_now, for the gatekeeper's in-line settlement: every call is settled here."""
        self.reconcile_now(reservation, used_tokens)
        return True

    def reconcile_now(self, reservation: Reservation, used_tokens: int) -> None:
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        now = time.monotonic_ns() // 1000
        self._reconcile(self._key_to_state.get(reservation.key_id), reservation.reservation_id, used_tokens, now)
        if reservation.in_share:
            self._reconcile(self._key_to_share.get(reservation.key_id), reservation.reservation_id, used_tokens, now)

    def _reconcile(self, state: _KeyState | None, reservation_id: str, used_tokens: int, now: int) -> None:
        if state is None:
            return
        self._prune(state, now)
        held = state.rid_to_held.pop(reservation_id, None)
        if held is None:  # reconciled already, or expired
            return
        delta = used_tokens - held.reserved_tokens
        # After pruning, what is still in its window is still in the deques, and only that counts.
        if held.admission.t_us > now - self.windows.window_us:
            state.num_window_tokens += delta
        held.admission.num_tokens = used_tokens
        if held.bucket.index > now // self.windows.bucket_us - NUM_DAY_BUCKETS:
            state.num_day_tokens += delta
        held.bucket.num_tokens += delta

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        return self.headers_now(key_id, spec)

    def headers_now(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        now = time.monotonic_ns() // 1000
        state = self._key_to_state.get(key_id) or _KeyState()
        self._prune(state, now)
        return rate_headers(spec, self._window_state(state, now))

    async def close(self) -> None:
        self._key_to_state.clear()
        self._key_to_share.clear()

    def _prune(self, state: _KeyState, now: int) -> None:
        window_start = now - self.windows.window_us  # in the window: t_us > window_start
        while state.window and state.window[0].t_us <= window_start:
            state.num_window_tokens -= state.window.popleft().num_tokens
        while state.leases and state.leases[0].t_us <= window_start:
            lease = state.leases.popleft()
            del state.id_to_lease[lease.lease_id]
            state.num_window_tokens -= lease.num_tokens
            state.num_lease_requests -= lease.num_requests
        first_live_bucket = now // self.windows.bucket_us - NUM_DAY_BUCKETS + 1
        while state.day and state.day[0].index < first_live_bucket:
            state.num_day_tokens -= state.day.popleft().num_tokens
        while state.expiry_order:
            expires_us, reservation_id = state.expiry_order[0]
            if reservation_id in state.rid_to_held and expires_us > now:
                break
            state.expiry_order.popleft()
            state.rid_to_held.pop(reservation_id, None)

    def _refusal(self, state: _KeyState, spec: LimitSpec, reserve_tokens: int, now: int,
                 by_share: bool = False) -> Refusal | None:
        """The failing limit that takes longest to pass, with that wait; None if all pass."""
        worst: tuple[int, str] | None = None  # (wait_us, kind)

        def fail(kind: str, wait_us: int) -> None:
            nonlocal worst
            assert wait_us > 0, (kind, wait_us)
            if worst is None or wait_us > worst[0]:
                worst = (wait_us, kind)

        windows = self.windows
        if spec.rpm is not None and state.num_requests >= spec.rpm:
            # Admissible once the (num_requests - rpm + 1) oldest have left.
            if not state.leases:
                fail("requests", state.window[len(state.window) - spec.rpm].t_us + windows.window_us - now)
            else:
                num_to_leave, num_left = state.num_requests - spec.rpm + 1, 0
                for entry in state.entries():
                    num_left += entry.num_requests if isinstance(entry, _Lease) else 1
                    if num_left >= num_to_leave:
                        fail("requests", entry.t_us + windows.window_us - now)
                        break
        if spec.tpm is not None and state.num_window_tokens + reserve_tokens > spec.tpm:
            num_to_free, num_freed = state.num_window_tokens + reserve_tokens - spec.tpm, 0
            for admission in state.entries():
                num_freed += admission.num_tokens
                if num_freed >= num_to_free:
                    fail("tokens", admission.t_us + windows.window_us - now)
                    break
        if spec.tpd is not None and state.num_day_tokens + reserve_tokens > spec.tpd:
            num_to_free, num_freed = state.num_day_tokens + reserve_tokens - spec.tpd, 0
            for bucket in state.day:
                num_freed += bucket.num_tokens
                if num_freed >= num_to_free:
                    fail("tokens_per_day", (bucket.index + NUM_DAY_BUCKETS) * windows.bucket_us - now)
                    break
        if spec.max_concurrent is not None and len(state.rid_to_held) >= spec.max_concurrent:
            fail("concurrency", round(CONCURRENCY_RETRY_S * 1e6))
        return None if worst is None else Refusal(worst[1], worst[0], by_share)

    def _window_state(self, state: _KeyState, now: int) -> WindowState:
        window_us = self.windows.window_us
        newest = max(state.window[-1].t_us if state.window else 0, state.leases[-1].t_us if state.leases else 0)
        requests_reset_us = newest + window_us - now if newest else 0
        tokens_reset_us = 0
        if state.num_window_tokens > 0:
            newest = max(next((a.t_us for a in reversed(state.window) if a.num_tokens > 0), 0),
                         next((a.t_us for a in reversed(state.leases) if a.num_tokens > 0), 0))
            tokens_reset_us = newest + window_us - now
        return WindowState(state.num_requests, requests_reset_us, state.num_window_tokens, tokens_reset_us)


def limits_backend(url: str | None) -> str:
    """Which store --limits-url names, for the limits and the budgets alike: "memory" (None or
    "memory", in process) or "redis" ("redis://...", "rediss://...", "unix://...")."""
    if url is None or url == "memory":
        return "memory"
    if url.startswith(("redis://", "rediss://", "unix://")):
        return "redis"
    raise ValueError(f"limits backend must be 'memory' or a redis:// URL, got {url!r}")


def make_limiter(url: str | None) -> Limiter:
    """In process, or a Redis that this process admits most calls from leases on (leases.py):
    a Redis round trip about once a second per key rather than one a call."""
    if limits_backend(url) == "memory":
        return InProcessLimiter()
    assert url is not None  # None is "memory"
    from tokenway.gateway.leases import LeasedLimiter
    from tokenway.gateway.limits_redis import RedisLimiter  # redis is only needed for this backend

    return LeasedLimiter(RedisLimiter(url))
