from tokenway.gateway.stages import STAGES, StageClock


def test_stages_add_up_to_the_total_even_with_missing_marks():
    clock = StageClock(received=100.0)
    clock.mark("validated", 100.001)
    clock.mark("submitted", 100.003)
    clock.mark("first_token", 100.2)  # never marked "scheduled": queue and prefill merge
    clock.mark("last_token", 100.9)
    clock.mark("done", 100.905)
    durations = clock.durations_ms()
    assert list(durations) == list(STAGES)
    assert abs(sum(durations.values()) - 905.0) < 1e-6
    assert durations["queue"] == 0.0 and abs(durations["prefill"] - 197.0) < 1e-6
    header = clock.server_timing()
    assert header.startswith("gateway;dur=1.00, tokenize;dur=2.00") and header.endswith("total;dur=905.00")


def test_a_request_that_failed_early_has_only_gateway_time():
    clock = StageClock(received=5.0)
    clock.mark("done", 5.002)
    durations = clock.durations_ms()
    assert abs(durations["gateway"] - 2.0) < 1e-9
    assert sum(durations.values()) == durations["gateway"]
