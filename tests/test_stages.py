import pytest

from tokenway.stages import STAGES, StageClock


def completed_clock() -> StageClock:
    clock = StageClock(received=100.0)
    for stage, at in (("auth", 100.0001), ("validation", 100.0005), ("routing", 100.0006), ("tokenize", 100.002),
                      ("limits", 100.0021), ("queue", 100.010), ("prefill", 100.200), ("decode", 100.900),
                      ("postprocess", 100.901)):
        clock.end(stage, at)
    clock.billing_started = 100.9012
    clock.done = 100.9035
    return clock


def test_every_stage_is_the_time_since_the_previous_mark_and_they_add_up():
    durations = completed_clock().durations_ms()
    assert list(durations) == list(STAGES)
    assert durations["auth"] == pytest.approx(0.1)
    assert durations["tokenize"] == pytest.approx(1.4)
    assert durations["prefill"] == pytest.approx(190.0)
    # billing runs from the end of postprocess (the commit starting 0.2 ms later) to the last byte
    assert durations["postprocess"] == pytest.approx(1.0)
    assert durations["billing"] == pytest.approx(2.5)
    assert sum(durations.values()) == pytest.approx(903.5)
    assert completed_clock().total_ms == pytest.approx(903.5)
    assert completed_clock().ttft_ms == pytest.approx(200.0)


def test_a_skipped_stage_is_zero_and_its_time_goes_to_the_next_marked_one():
    clock = StageClock(received=100.0)
    clock.end("auth", 100.001)
    clock.end("tokenize", 100.003)  # validation and routing never marked
    clock.end("prefill", 100.2)  # limits and queue never marked
    clock.end("decode", 100.9)
    clock.done = 100.905
    durations = clock.durations_ms()
    assert durations["validation"] == durations["routing"] == durations["limits"] == durations["queue"] == 0.0
    assert durations["tokenize"] == pytest.approx(2.0) and durations["prefill"] == pytest.approx(197.0)
    # No billing: the time after the last mark is the stage under way.
    assert durations["postprocess"] == pytest.approx(5.0)
    assert sum(durations.values()) == pytest.approx(905.0)


def test_a_request_refused_by_the_limiter_spends_its_tail_in_limits():
    clock = StageClock(received=5.0)
    for stage, at in (("auth", 5.001), ("validation", 5.002), ("routing", 5.003), ("tokenize", 5.004)):
        clock.end(stage, at)
    clock.billing_started = 5.006
    clock.done = 5.007
    durations = clock.durations_ms()
    assert durations["limits"] == pytest.approx(2.0) and durations["billing"] == pytest.approx(1.0)
    assert durations["queue"] == durations["decode"] == 0.0
    assert sum(durations.values()) == pytest.approx(7.0)


def test_a_request_refused_at_auth_is_all_auth():
    clock = StageClock(received=5.0)
    clock.done = 5.002
    durations = clock.durations_ms()
    assert durations["auth"] == pytest.approx(2.0)
    assert sum(durations.values()) == durations["auth"]
    assert clock.ttft_ms is None


def test_marks_out_of_order_never_give_negative_stages():
    # The engine's stamps come from another thread; one may land before the gateway's mark.
    clock = StageClock(received=1.0)
    clock.end("limits", 1.010)
    clock.end("queue", 1.005)
    clock.done = 1.020
    durations = clock.durations_ms()
    assert min(durations.values()) >= 0.0
    assert sum(durations.values()) == pytest.approx(20.0)


def test_server_timing_lists_every_stage_and_the_total():
    header = completed_clock().server_timing()
    parts = dict(item.split(";dur=") for item in header.split(", "))
    assert list(parts) == [*STAGES, "total"]
    assert float(parts["total"]) == pytest.approx(sum(float(parts[s]) for s in STAGES), abs=0.02)
