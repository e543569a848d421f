"""The circuit breaker's transitions on a hand-moved clock; ReplicaHealth's verdicts; the
HealthChecker on a real event loop, asserted on state changes (never on durations)."""

from __future__ import annotations

import asyncio

import pytest

from tokenway.routing.health import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    HealthCheckConfig,
    HealthChecker,
    ReplicaHealth,
    Unavailable,
)

CONFIG = BreakerConfig(failure_threshold=3, failure_window=10.0, cooldown=5.0)


def make_breaker(clock) -> CircuitBreaker:
    return CircuitBreaker(CONFIG, clock=clock)


def open_breaker(breaker: CircuitBreaker) -> None:
    for _ in range(CONFIG.failure_threshold):
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN


# --- CircuitBreaker -----------------------------------------------------------------------


def test_opens_after_exactly_threshold_failures(clock):
    breaker = make_breaker(clock)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert breaker.num_recent_failures == 2
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow()


def test_failures_older_than_the_window_do_not_count(clock):
    breaker = make_breaker(clock)
    breaker.record_failure()
    breaker.record_failure()
    clock.advance(CONFIG.failure_window)  # both now exactly window-old: out
    assert breaker.num_recent_failures == 0
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    clock.advance(CONFIG.failure_window - 1.0)  # the last two still count
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN


def test_successes_do_not_erase_failures_while_closed(clock):
    breaker = make_breaker(clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN


def test_open_until_the_cooldown_then_half_open_admits_exactly_one(clock):
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(CONFIG.cooldown - 0.001)
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    assert breaker.seconds_until_half_open() == pytest.approx(0.001)
    clock.advance(0.001)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.would_allow()  # peeking claims nothing
    assert breaker.allow()
    assert breaker.probe_in_flight
    assert not breaker.allow() and not breaker.allow()
    clock.advance(60.0)  # still one probe, however long it runs
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allow()


def test_probe_success_closes_with_no_failures_remembered(clock):
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(CONFIG.cooldown)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.allow()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED  # a fresh count: 2 < 3


def test_probe_failure_reopens_for_a_full_cooldown(clock):
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(CONFIG.cooldown + 2.0)
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.probe_in_flight
    clock.advance(CONFIG.cooldown - 0.001)
    assert breaker.state is BreakerState.OPEN
    clock.advance(0.001)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allow()


def test_outcomes_while_open_are_ignored(clock):
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(1.0)
    breaker.record_success()  # a call admitted before it opened
    assert breaker.state is BreakerState.OPEN
    breaker.record_failure()  # does not push the cooldown back
    clock.advance(CONFIG.cooldown - 1.0)
    assert breaker.state is BreakerState.HALF_OPEN


def test_half_open_with_no_probe_out_ignores_outcomes(clock):
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(CONFIG.cooldown)
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allow()


def test_abandoned_probe_lets_another_call_probe(clock):
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(CONFIG.cooldown)
    assert breaker.allow() and not breaker.allow()
    breaker.abandon_probe()
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow() and not breaker.allow()


@pytest.mark.parametrize("kwargs", [{"failure_threshold": 0}, {"failure_window": 0.0}, {"cooldown": -1.0}])
def test_breaker_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        BreakerConfig(**kwargs)


# --- ReplicaHealth ------------------------------------------------------------------------


def test_unavailable_reason_names_each_cause(clock):
    health = ReplicaHealth("a", make_breaker(clock))
    assert health.unavailable_reason is None and health.is_up  # optimistic before any probe
    for _ in range(CONFIG.failure_threshold):
        health.record_failure()
    assert health.unavailable_reason is Unavailable.BREAKER_OPEN
    assert health.retry_after() == pytest.approx(CONFIG.cooldown)
    clock.advance(CONFIG.cooldown)
    assert health.unavailable_reason is None  # half-open, its probe slot free
    assert health.allow()
    assert health.unavailable_reason is Unavailable.HALF_OPEN_BUSY
    assert health.retry_after() is None
    health.record_probe(False, "connection refused")
    assert health.unavailable_reason is Unavailable.DOWN_BY_PROBE  # the probe's verdict first
    assert not health.allow()
    view = health.view()
    assert (view.name, view.unavailable_reason, view.breaker_state, view.is_up, view.last_probe_error) == (
        "a", Unavailable.DOWN_BY_PROBE, BreakerState.HALF_OPEN, False, "connection refused")


def test_back_up_after_a_probe_verdict_resets_the_breaker(clock):
    health = ReplicaHealth("a", make_breaker(clock))
    health.record_probe(False)
    for _ in range(CONFIG.failure_threshold):
        health.record_failure()  # its in-flight calls failed as it died
    assert health.breaker.state is BreakerState.OPEN
    health.record_probe(True)  # restarted: no cooldown to wait out
    assert health.unavailable_reason is None and health.breaker.state is BreakerState.CLOSED
    assert health.last_probe_error is None


def test_a_good_probe_while_up_leaves_an_open_breaker_open(clock):
    """An upstream whose health endpoint is fine but whose calls fail stays broken."""
    health = ReplicaHealth("a", make_breaker(clock))
    for _ in range(CONFIG.failure_threshold):
        health.record_failure()
    health.record_probe(True)
    assert health.unavailable_reason is Unavailable.BREAKER_OPEN


def test_listeners_hear_probe_flips_only(clock):
    health = ReplicaHealth("a", make_breaker(clock))
    flips = []
    health.subscribe(lambda: flips.append(health.is_up))
    health.record_probe(True)
    health.record_probe(False)
    health.record_probe(False)
    health.record_probe(True)
    for _ in range(CONFIG.failure_threshold):
        health.record_failure()
    assert flips == [False, True]


# --- HealthChecker ------------------------------------------------------------------------


class FlippingProbe:
    """A replica's probe the test switches between healthy, refusing and hanging."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.num_calls = 0

    async def __call__(self) -> bool:
        self.num_calls += 1
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "raise":
            raise ConnectionRefusedError("connection refused")
        return self.mode == "ok"


async def wait_until_up_is(health: ReplicaHealth, is_up: bool) -> None:
    """Wait for the flip itself; the generous timeout only stops a broken checker hanging the suite."""
    flipped = asyncio.Event()
    health.subscribe(lambda: flipped.set() if health.is_up == is_up else None)
    if health.is_up != is_up:
        await asyncio.wait_for(flipped.wait(), timeout=10.0)


def test_default_timing_marks_down_and_up_within_two_seconds():
    config = HealthCheckConfig()
    assert config.interval + config.timeout < 2.0  # a dead replica: next probe, then its timeout
    assert config.interval < 2.0  # a restarted one: the next probe


@pytest.mark.parametrize("failing_mode", ["unhealthy", "raise", "hang"])
def test_checker_marks_a_replica_down_then_up_again(failing_mode):
    probe = FlippingProbe()
    health = ReplicaHealth("a")

    async def main() -> tuple[str | None, int]:
        checker = HealthChecker({"a": probe}, {"a": health}, HealthCheckConfig(interval=0.01, timeout=0.05))
        checker.start()
        try:
            await asyncio.sleep(0)
            probe.mode = failing_mode
            await wait_until_up_is(health, False)
            reason, error = health.unavailable_reason, health.last_probe_error
            probe.mode = "ok"
            await wait_until_up_is(health, True)
            return reason, error
        finally:
            await checker.stop()

    reason, error = asyncio.run(main())
    assert reason is Unavailable.DOWN_BY_PROBE
    assert error == {"unhealthy": "probe answered unhealthy",
                     "raise": "probe failed: ConnectionRefusedError: connection refused",
                     "hang": "probe timed out after 0.05 s"}[failing_mode]
    assert health.is_up and health.unavailable_reason is None and health.last_probe_error is None


def test_a_hung_replica_does_not_delay_another_ones_verdict():
    hung, flipping = FlippingProbe(), FlippingProbe()
    hung.mode = "hang"
    name_to_health = {"hung": ReplicaHealth("hung"), "b": ReplicaHealth("b")}

    async def main() -> None:
        # The hung probe's timeout is far longer than the wait below allows for its neighbour.
        checker = HealthChecker({"hung": hung, "b": flipping}, name_to_health,
                                HealthCheckConfig(interval=0.01, timeout=30.0))
        checker.start()
        try:
            flipping.mode = "unhealthy"
            await wait_until_up_is(name_to_health["b"], False)
        finally:
            await checker.stop()

    asyncio.run(main())
    assert name_to_health["hung"].is_up  # never answered, never timed out: no verdict yet
    assert hung.num_calls == 1


def test_check_once_and_stop_cancels_the_probes():
    probe = FlippingProbe()
    health = ReplicaHealth("a")

    async def main() -> int:
        checker = HealthChecker({"a": probe}, {"a": health}, HealthCheckConfig(interval=0.01, timeout=0.05))
        probe.mode = "unhealthy"
        assert not await checker.check("a")
        assert not health.is_up
        checker.start()
        with pytest.raises(RuntimeError):
            checker.start()
        await asyncio.sleep(0.05)
        await checker.stop()
        num_calls = probe.num_calls
        await asyncio.sleep(0.05)
        return probe.num_calls - num_calls

    assert asyncio.run(main()) == 0  # nothing probes after stop


def test_checker_needs_a_health_for_every_probe():
    with pytest.raises(ValueError, match="b"):
        HealthChecker({"a": FlippingProbe(), "b": FlippingProbe()}, {"a": ReplicaHealth("a")})
