"""Whether a replica may take a call: a circuit breaker fed by the calls themselves, and an
active probe that runs whether or not calls arrive.

The breaker, one per replica (time from an injectable monotonic clock):

              failure_threshold failures within failure_window
     CLOSED ───────────────────────────────────────────────────► OPEN
       ▲                                                         │  ▲
       │ the probe call succeeds               cooldown elapsed  │  │ the probe call fails
       │                                                         ▼  │ (cooldown starts again)
       └──────────────────────────────────────────────────── HALF_OPEN
                                            admits exactly one call, the probe

- CLOSED admits every call. A failure older than failure_window no longer counts; successes do
  not erase failures (N failures within the window open it, whatever else happened).
- OPEN admits none. Outcomes of calls admitted before it opened are ignored.
- HALF_OPEN admits one call. While it runs, any outcome recorded settles the state: a late
  result from a call admitted earlier is evidence about the same replica at about the same
  time. A probe that ends with no outcome (the client went away) frees the slot for another.

ReplicaHealth joins the breaker (passive detection: the caller records each call's outcome)
with the last active probe (HealthChecker calls every replica's probe every `interval` seconds,
each bounded by `timeout`: one failed probe marks it down, one good probe marks it up). A
replica is available when it is up and its breaker admits a call; otherwise
`unavailable_reason` says why, for traces and the dashboard. A replica that comes back up
after being down by probe starts with a closed breaker: a restarted process owes nothing to
the failures of the one before it (and would otherwise wait out a cooldown it does not need).

With the defaults a dead replica is down within interval + timeout = 1.5 s, and a restarted
one up within interval = 0.5 s of answering its probe.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

Clock = Callable[[], float]
Probe = Callable[[], Awaitable[bool]]  # True: healthy; False, a raise or a timeout: not


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Unavailable(enum.StrEnum):
    """Why a replica takes no call now."""

    DOWN_BY_PROBE = "down_by_probe"
    BREAKER_OPEN = "breaker_open"
    HALF_OPEN_BUSY = "half_open_busy"  # its one probe call is in flight


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5
    failure_window: float = 10.0  # seconds
    cooldown: float = 5.0  # seconds open before the probe call

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold: must be >= 1, got {self.failure_threshold}")
        if self.failure_window <= 0 or self.cooldown <= 0:
            raise ValueError("failure_window, cooldown: must be > 0 seconds")


class CircuitBreaker:
    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Clock = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._failure_times: deque[float] = deque()  # closed only; oldest first
        self._opened_at: float | None = None  # None: closed
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() < self._opened_at + self.config.cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    @property
    def probe_in_flight(self) -> bool:
        return self._probe_in_flight and self.state is BreakerState.HALF_OPEN

    @property
    def num_recent_failures(self) -> int:
        self._forget_old_failures()
        return len(self._failure_times)

    def seconds_until_half_open(self) -> float:
        """0 unless open."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        assert self._opened_at is not None
        return self._opened_at + self.config.cooldown - self._clock()

    def would_allow(self) -> bool:
        """allow() without claiming the half-open probe."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probe_in_flight)

    def allow(self) -> bool:
        """Whether a call may go; in HALF_OPEN a True claims the one probe call."""
        if not self.would_allow():
            return False
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        if self.state is BreakerState.HALF_OPEN and self._probe_in_flight:
            self.reset()

    def record_failure(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN and self._probe_in_flight:
            self._open()
        elif state is BreakerState.CLOSED:
            self._failure_times.append(self._clock())
            self._forget_old_failures()
            if len(self._failure_times) >= self.config.failure_threshold:
                self._open()

    def abandon_probe(self) -> None:
        """The probe call ended with no outcome: let another call be the probe."""
        self._probe_in_flight = False

    def reset(self) -> None:
        """Closed, with no failures remembered."""
        self._opened_at = None
        self._probe_in_flight = False
        self._failure_times.clear()

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._probe_in_flight = False
        self._failure_times.clear()

    def _forget_old_failures(self) -> None:
        oldest_counted = self._clock() - self.config.failure_window
        while self._failure_times and self._failure_times[0] <= oldest_counted:
            self._failure_times.popleft()


@dataclass(frozen=True, slots=True)
class HealthView:
    """One replica's health as traces and the dashboard show it."""

    name: str
    unavailable_reason: Unavailable | None
    breaker_state: BreakerState
    is_up: bool  # the last active probe's verdict (True before the first probe)
    num_recent_failures: int
    last_probe_error: str | None


class ReplicaHealth:
    """One replica's breaker and probe verdict. The caller records call outcomes here (or via
    its balancer Lease); HealthChecker records probes."""

    def __init__(self, name: str, breaker: CircuitBreaker | None = None) -> None:
        self.name = name
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        # Called when a probe flips is_up (the balancer wakes its queue on them).
        self._listeners: list[Callable[[], None]] = []
        # Optimistic until the first probe: a pool must serve before its first check lands.
        self.is_up = True
        self.last_probe_error: str | None = None

    @property
    def unavailable_reason(self) -> Unavailable | None:
        if not self.is_up:
            return Unavailable.DOWN_BY_PROBE
        state = self.breaker.state
        if state is BreakerState.OPEN:
            return Unavailable.BREAKER_OPEN
        if state is BreakerState.HALF_OPEN and self.breaker.probe_in_flight:
            return Unavailable.HALF_OPEN_BUSY
        return None

    def allow(self) -> bool:
        return self.is_up and self.breaker.allow()

    def record_success(self) -> None:
        self.breaker.record_success()

    def record_failure(self) -> None:
        self.breaker.record_failure()

    def record_probe(self, ok: bool, error: str | None = None) -> None:
        was_up = self.is_up
        self.is_up = ok
        self.last_probe_error = None if ok else (error or "probe failed")
        if ok and not was_up:
            self.breaker.reset()
        if ok != was_up:
            for listener in self._listeners:
                listener()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call listener() whenever a probe marks this replica up or down."""
        self._listeners.append(listener)

    def retry_after(self) -> float | None:
        """Seconds until its breaker half-opens, when that is why it is unavailable; else None
        (a probe verdict or a busy probe call has no known end)."""
        if self.unavailable_reason is Unavailable.BREAKER_OPEN:
            return self.breaker.seconds_until_half_open()
        return None

    def view(self) -> HealthView:
        return HealthView(self.name, self.unavailable_reason, self.breaker.state, self.is_up,
                          self.breaker.num_recent_failures, self.last_probe_error)


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    interval: float = 0.5  # seconds from one probe's start to the next
    timeout: float = 1.0  # a probe slower than this failed

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.timeout <= 0:
            raise ValueError("interval, timeout: must be > 0 seconds")


class HealthChecker:
    """Probes every replica on its own task, so one hung replica delays no other's verdict.

        checker = HealthChecker(name_to_probe, name_to_health); checker.start() ... await checker.stop()
    """

    def __init__(self, name_to_probe: Mapping[str, Probe], name_to_health: Mapping[str, ReplicaHealth],
                 config: HealthCheckConfig = HealthCheckConfig()) -> None:
        missing = set(name_to_probe) - set(name_to_health)
        if missing:
            raise ValueError(f"name_to_health: no ReplicaHealth for {sorted(missing)}")
        self.config = config
        self._name_to_probe = dict(name_to_probe)
        self._name_to_health = name_to_health
        self._tasks: list[asyncio.Task[None]] = []

    async def check(self, name: str) -> bool:
        """Run one probe now and record its verdict."""
        health = self._name_to_health[name]
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
            # lands as the probe finishes, and stop() would then wait for a loop that never ends.
            async with asyncio.timeout(self.config.timeout):
                ok = bool(await self._name_to_probe[name]())
            error = None if ok else "probe answered unhealthy"
        except TimeoutError:
            ok, error = False, f"probe timed out after {self.config.timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure of the probe is the replica's failure
            ok, error = False, f"probe failed: {type(exc).__name__}: {exc}"[:200]
        health.record_probe(ok, error)
        return ok

    def start(self) -> None:
        """Start probing; call from a running event loop."""
        if self._tasks:
            raise RuntimeError("HealthChecker already started")
        self._tasks = [asyncio.create_task(self._run(name), name=f"health-check:{name}")
                       for name in self._name_to_probe]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.check(name)
            await asyncio.sleep(max(0.0, started + self.config.interval - loop.time()))
