"""Calls that survive 429s, 5xx, hung servers and dropped streams, on the official openai SDK.

    chat = ResilientChat([Endpoint(openai.AsyncOpenAI(base_url=...)),            # preferred
                          Endpoint(openai.AsyncOpenAI(base_url=...), model="backup-model")],
                         Policy(max_attempts=5, attempt_timeout=30, deadline=60, ttft_timeout=5))
    reply = await chat.create(model="m", messages=[...])          # a ChatCompletion
    async with await chat.stream(model="m", messages=[...]) as stream:
        async for chunk in stream:                                  # ChatCompletionChunks
            ...
    stream.result            # StreamResult: complete or not, the text and tool calls that arrived
    await chat.stream(**stream.result.continue_request(request))   # go on from where it broke

One call is a sequence of attempts, each on an endpoint (a client, and optionally the model to
ask it for: failover to a second server or model). Before every attempt the plan picks the
first endpoint, in the order given, that is ready: its circuit breaker admits a call (one per
endpoint, tokenway.routing.health's, shared by every call of this ResilientChat) and any wait
it was told to keep has passed. Where none is ready it sleeps until the first one is.

- Retryable: 408, 409, 429, 5xx, connection errors, timeouts (attempt, time to first token).
  Anything else (400, 401, 404, context_length_exceeded ...) is raised at once, unchanged.
- The wait after a failure: the server's `retry-after-ms` or `Retry-After` (seconds or an
  HTTP date), exactly; otherwise full jitter, uniform(0, min(max_delay, base_delay * 2**n)) for
  the endpoint's n-th failure in this call. A wait longer than max_retry_after, or past the
  deadline, ends the call now rather than sleeping for nothing.
- 5xx, connection errors and timeouts count against the endpoint's breaker; a 429 does not (the
  server is alive and said when to come back).
- Timeouts: attempt_timeout bounds one attempt (for a stream: opening it), deadline the whole
  call from the first attempt to the last chunk, ttft_timeout a stream's wait for its first
  token. A stream is retried only before its first token: after that a retry would repeat text
  the caller has already shown, so a break ends the stream with an incomplete StreamResult.
- Cancelling (stream.close(), leaving `async with`, or cancelling the task) closes the HTTP
  connection, so the server aborts the request and frees its slot.

Out of attempts or time: RetriesExhausted / DeadlineExceeded, holding every attempt's error.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from tokenway.routing.health import BreakerConfig, CircuitBreaker

RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Policy:
    max_attempts: int = 5  # over all endpoints
    base_delay: float = 0.5  # seconds; the jittered backoff's scale
    max_delay: float = 20.0
    max_retry_after: float = 60.0  # a server asking for a longer wait ends the call instead
    attempt_timeout: float | None = 60.0
    deadline: float | None = None  # seconds for the whole call
    ttft_timeout: float | None = None  # seconds from a stream's request to its first token
    breaker: BreakerConfig = BreakerConfig()

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1, got {self.max_attempts}")
        for name in ("attempt_timeout", "deadline", "ttft_timeout"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name}: must be > 0 seconds or None, got {value}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A client to call, and the model to ask it for (None: the request's own)."""

    client: Any  # openai.AsyncOpenAI (or openai.OpenAI for ResilientChat's sync sibling)
    model: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", f"{self.client.base_url}#{self.model or '*'}")

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        return {**request, "model": self.model} if self.model else request


@dataclass(frozen=True, slots=True)
class Attempt:
    endpoint: str
    error: BaseException
    status: int | None  # the HTTP status, where there was one
    waited: float  # seconds slept before the next attempt (0 after the last)


class CallFailed(Exception):
    def __init__(self, message: str, attempts: Sequence[Attempt]) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


class RetriesExhausted(CallFailed):
    """Every attempt failed with a retryable error, or the next wait was too long."""


class DeadlineExceeded(CallFailed, TimeoutError):
    """The call's deadline passed (or would have, waiting for the next attempt)."""


class FirstTokenTimeout(TimeoutError):
    """A stream's first token did not come within ttft_timeout (an attempt's error: retried)."""


def status_of(error: BaseException) -> int | None:
    return getattr(error, "status_code", None)


def retry_after(error: BaseException, now_wall: float | None = None) -> float | None:
    """Seconds the server asked to wait: retry-after-ms, else Retry-After (seconds or a date)."""
    response = getattr(error, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now_wall is None else now_wall))


def is_retryable(error: BaseException) -> bool:
    status = status_of(error)
    if status is not None:
        return status in RETRYABLE_STATUSES or status >= 500
    # The SDK's APIConnectionError (and APITimeoutError), httpx's own, and our timeouts.
    return isinstance(error, (TimeoutError, httpx.TransportError, ConnectionError)) \
        or type(error).__name__ in ("APIConnectionError", "APITimeoutError")


def counts_against_breaker(error: BaseException) -> bool:
    status = status_of(error)
    return status is None or status >= 500


class Plan:
    """One call's attempts (sans I/O: the caller sleeps and calls). Usage:

        while True:
            endpoint, delay = plan.next()   # raises when the call is over
            sleep(delay)
            if not plan.claim(endpoint): continue
            try: result = call(endpoint, timeout=plan.timeout())
            except Exception as exc: plan.failed(endpoint, exc); continue   # raises if final
            plan.succeeded(endpoint); return result
    """

    def __init__(self, policy: Policy, endpoints: Sequence[Endpoint], breakers: dict[str, CircuitBreaker],
                 clock=time.monotonic, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.endpoints = endpoints
        self.breakers = breakers
        self.clock = clock
        self.rng = rng or random.Random()
        self.started = clock()
        self.attempts: list[Attempt] = []
        self._not_before = {endpoint.name: 0.0 for endpoint in endpoints}
        self._num_failures = {endpoint.name: 0 for endpoint in endpoints}

    def remaining(self) -> float | None:
        deadline = self.policy.deadline
        return None if deadline is None else deadline - (self.clock() - self.started)

    def timeout(self, limit: float | None = None) -> float | None:
        """This attempt's bound: attempt_timeout (or `limit`) cut to what the deadline leaves."""
        limit = self.policy.attempt_timeout if limit is None else limit
        remaining = self.remaining()
        if remaining is None:
            return limit
        return remaining if limit is None else min(limit, remaining)

    def next(self) -> tuple[Endpoint, float]:
        if len(self.attempts) >= self.policy.max_attempts:
            raise self._over(RetriesExhausted, f"{len(self.attempts)} attempts failed")
        now = self.clock()
        best, best_at = self.endpoints[0], float("inf")
        for endpoint in self.endpoints:
            ready_at = max(self._not_before[endpoint.name], now + self._breaker_wait(endpoint))
            if ready_at < best_at:
                best, best_at = endpoint, ready_at
        delay = max(0.0, best_at - now)
        remaining = self.remaining()
        if remaining is not None and delay >= remaining:
            raise self._over(DeadlineExceeded, f"the deadline of {self.policy.deadline}s passes before "
                                               f"an endpoint is ready (in {delay:.2f}s)")
        if self.attempts:
            self.attempts[-1] = _with_wait(self.attempts[-1], delay)
        return best, delay

    def claim(self, endpoint: Endpoint) -> bool:
        """Ask the endpoint's breaker for this attempt (in half-open: the one probe)."""
        return self.breaker(endpoint).allow()

    def succeeded(self, endpoint: Endpoint) -> None:
        self.breaker(endpoint).record_success()

    def abandoned(self, endpoint: Endpoint) -> None:
        """The attempt ended with no outcome (cancelled): let another call be the probe."""
        self.breaker(endpoint).abandon_probe()

    def failed(self, endpoint: Endpoint, error: BaseException) -> None:
        """Record the attempt; raise `error` itself if it is not retryable, or a CallFailed if
        the call is now over."""
        breaker = self.breaker(endpoint)
        self.attempts.append(Attempt(endpoint.name, error, status_of(error), 0.0))
        if not is_retryable(error):
            breaker.record_success()  # it answered: a 400 is the request's fault, not the endpoint's
            raise error
        if counts_against_breaker(error):
            breaker.record_failure()
        else:
            breaker.abandon_probe()
        self._num_failures[endpoint.name] += 1
        wait = retry_after(error)
        if wait is not None and wait > self.policy.max_retry_after:
            raise self._over(RetriesExhausted, f"{endpoint.name} asks to wait {wait:.1f}s, over "
                                               f"max_retry_after={self.policy.max_retry_after}s")
        if wait is None:
            scale = self.policy.base_delay * 2 ** (self._num_failures[endpoint.name] - 1)
            wait = self.rng.uniform(0, min(self.policy.max_delay, scale))
        self._not_before[endpoint.name] = self.clock() + wait

    def breaker(self, endpoint: Endpoint) -> CircuitBreaker:
        breaker = self.breakers.get(endpoint.name)
        if breaker is None:
            breaker = self.breakers[endpoint.name] = CircuitBreaker(self.policy.breaker, self.clock)
        return breaker

    def _breaker_wait(self, endpoint: Endpoint) -> float:
        breaker = self.breaker(endpoint)
        if breaker.would_allow():
            return 0.0
        # Open: until half-open. Half-open with another call's probe in flight: look again soon.
        return breaker.seconds_until_half_open() or 0.05

    def _over(self, kind: type[CallFailed], why: str) -> CallFailed:
        errors = "; ".join(f"{a.endpoint}: {type(a.error).__name__} {a.status or ''}".rstrip()
                           for a in self.attempts[-5:])
        failure = kind(f"{why}{' (' + errors + ')' if errors else ''}", self.attempts)
        if self.attempts:
            failure.__cause__ = self.attempts[-1].error
        return failure


def _with_wait(attempt: Attempt, waited: float) -> Attempt:
    return Attempt(attempt.endpoint, attempt.error, attempt.status, waited)

