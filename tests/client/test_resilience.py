"""resilience.Plan on a fake clock: which endpoint, how long to wait, when to give up; and the
stream accumulator's rule for cut tool calls."""

from __future__ import annotations

import email.utils
import random
from types import SimpleNamespace

import httpx
import openai
import pytest

from tokenway.client.resilience import (
    DeadlineExceeded,
    Endpoint,
    FirstTokenTimeout,
    Plan,
    Policy,
    RetriesExhausted,
    is_retryable,
    retry_after,
)
from tokenway.client.streaming import Accumulator
from tokenway.routing.health import BreakerConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def status_error(status: int, headers: dict[str, str] | None = None) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    response = httpx.Response(status, headers=headers or {}, request=request)
    return openai.APIStatusError(f"status {status}", response=response, body=None)


def endpoints(*names: str) -> list[Endpoint]:
    return [Endpoint(SimpleNamespace(base_url=f"http://{name}/v1/")) for name in names]


def plan(policy: Policy = Policy(), names=("a",), clock=None, breakers=None) -> Plan:
    return Plan(policy, endpoints(*names), {} if breakers is None else breakers, clock or Clock(),
                random.Random(0))


def test_retry_after_forms():
    assert retry_after(status_error(429, {"retry-after-ms": "1500"})) == 1.5
    assert retry_after(status_error(429, {"retry-after": "2"})) == 2.0
    assert retry_after(status_error(429, {"retry-after-ms": "250", "retry-after": "9"})) == 0.25
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after(status_error(503, {"retry-after": date}), now_wall=1_000_000) == 30
    assert retry_after(status_error(503, {"retry-after": "soon"})) is None
    assert retry_after(status_error(503)) is None and retry_after(ValueError()) is None


def test_what_is_retried():
    for status in (408, 409, 429, 500, 502, 503, 504, 529):
        assert is_retryable(status_error(status))
    for status in (400, 401, 403, 404, 422):
        assert not is_retryable(status_error(status))
    assert is_retryable(openai.APIConnectionError(request=httpx.Request("POST", "http://x")))
    assert is_retryable(FirstTokenTimeout()) and is_retryable(httpx.ReadError("reset"))
    assert not is_retryable(ValueError("bad"))


def test_retry_after_is_kept_exactly_and_backoff_is_full_jitter():
    clock = Clock()
    p = plan(Policy(base_delay=1.0, max_delay=3.0), clock=clock)
    endpoint, delay = p.next()
    assert delay == 0 and p.claim(endpoint)
    p.failed(endpoint, status_error(429, {"retry-after": "1.25"}))
    assert p.next()[1] == 1.25
    delays = []
    for _ in range(3):
        clock.now += 10
        p.failed(endpoint, status_error(500))
        delays.append(p.next()[1])
    # The n-th failure waits uniform(0, min(3, 2**(n-1))): failures 2, 3, 4 here.
    assert 0 <= delays[0] <= 2 and 0 <= delays[1] <= 3 and 0 <= delays[2] <= 3
    assert len(set(delays)) == 3


def test_errors_that_are_not_retryable_are_raised_unchanged():
    p = plan()
    endpoint, _ = p.next()
    error = status_error(400)
    with pytest.raises(openai.APIStatusError) as raised:
        p.failed(endpoint, error)
    assert raised.value is error


def test_attempts_run_out():
    p = plan(Policy(max_attempts=2, base_delay=0.0))
    for _ in range(2):
        endpoint, _ = p.next()
        p.failed(endpoint, status_error(503))
    with pytest.raises(RetriesExhausted) as over:
        p.next()
    assert [a.status for a in over.value.attempts] == [503, 503]
    assert isinstance(over.value.__cause__, openai.APIStatusError)


def test_a_wait_past_the_deadline_ends_the_call_now():
    clock = Clock()
    p = plan(Policy(deadline=5.0), clock=clock)
    endpoint, _ = p.next()
    clock.now += 2
    p.failed(endpoint, status_error(429, {"retry-after": "4"}))
    with pytest.raises(DeadlineExceeded):
        p.next()
    assert p.timeout() == pytest.approx(3.0)


def test_failover_goes_to_the_next_ready_endpoint_without_waiting():
    p = plan(Policy(base_delay=10.0), names=("a", "b"))
    first, _ = p.next()
    assert first.name.startswith("http://a")
    p.failed(first, status_error(500))
    second, delay = p.next()
    assert second.name.startswith("http://b") and delay == 0


def test_the_breaker_is_shared_across_calls_and_skips_an_open_endpoint():
    clock = Clock()
    breakers: dict = {}
    policy = Policy(base_delay=0.0, breaker=BreakerConfig(failure_threshold=2, failure_window=60, cooldown=5))
    for _ in range(2):
        p = plan(policy, names=("a", "b"), clock=clock, breakers=breakers)
        endpoint, _ = p.next()
        assert endpoint.name.startswith("http://a") and p.claim(endpoint)
        p.failed(endpoint, status_error(502))
    p = plan(policy, names=("a", "b"), clock=clock, breakers=breakers)
    assert p.next()[0].name.startswith("http://b")  # a is open
    clock.now += 5
    endpoint, _ = p.next()
    assert endpoint.name.startswith("http://a") and p.claim(endpoint)  # half-open: this call is the probe
    other = plan(policy, names=("a", "b"), clock=clock, breakers=breakers)
    assert other.next()[0].name.startswith("http://b")  # the probe is taken
    p.succeeded(endpoint)
    assert other.next()[0].name.startswith("http://a")


def test_429s_do_not_open_the_breaker():
    breakers: dict = {}
    policy = Policy(base_delay=0.0, breaker=BreakerConfig(failure_threshold=1))
    p = plan(policy, breakers=breakers)
    endpoint, _ = p.next()
    p.failed(endpoint, status_error(429))
    assert p.breaker(endpoint).would_allow()


def chunk(content=None, tool_calls=None, finish_reason=None):
    delta = SimpleNamespace(content=content, tool_calls=tool_calls)
    return SimpleNamespace(choices=[SimpleNamespace(index=0, delta=delta, finish_reason=finish_reason)], usage=None)


def call_delta(index, id=None, name=None, arguments=None):
    return SimpleNamespace(index=index, id=id, function=SimpleNamespace(name=name, arguments=arguments))


def test_the_accumulator_drops_a_cut_tool_call():
    accumulator = Accumulator()
    accumulator.add(chunk(tool_calls=[call_delta(0, "call_1", "get_weather", '{"city": ')]))
    accumulator.add(chunk(tool_calls=[call_delta(0, arguments='"Paris"}')]))
    accumulator.add(chunk(tool_calls=[call_delta(1, "call_2", "get_time", '{"zone": "Eur')]))
    accumulator.add(chunk(finish_reason="length"))
    result = accumulator.result()
    assert result.complete and result.finish_reason == "length"
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [("call_1", "get_weather", '{"city": "Paris"}')]
    assert result.num_cut_tool_calls == 1
    assert result.message()["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_broken_stream_continues_from_its_text():
    accumulator = Accumulator()
    accumulator.add(chunk("Once upon"))
    result = accumulator.result(error=ConnectionError("cut"))
    assert not result.complete and result.text == "Once upon"
    request = {"model": "m", "messages": [{"role": "user", "content": "A story."}], "extra_body": {"top_k": 3}}
    again = result.continue_request(request)
    assert again["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert again["extra_body"] == {"top_k": 3, "continue_final_message": True}
    assert request["messages"] == [{"role": "user", "content": "A story."}]  # not mutated
