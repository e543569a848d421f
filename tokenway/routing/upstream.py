"""What every HTTP upstream replica shares: one pooled httpx client, the event-stream reader
with its timers, the mapping of upstream failures onto tokenway's error tree, health probes.

    OpenAIUpstream / AnthropicUpstream ── body ─► UpstreamHTTP.stream_events(path, body, deadline)
        ─► SSEEvent ... (read as they arrive, timed, failures mapped) ─► the protocol's own
        translation ─► ChoiceDelta ... Usage

What the caller sees when the upstream fails:

    upstream answer                              tokenway error            why
    400, 413, 422                                InvalidRequestError 400   the caller's request; upstream's message, param, code
    401, 403, 404, any other 3xx/4xx             BadGatewayError 502       tokenway's config is wrong; upstream's message withheld
    429                                          RateLimitError 429        retry-after / retry-after-ms passed on
    503, 529 (Anthropic's overloaded)            ServiceUnavailableError   retry-after passed on
    500, 502, 504, any other 5xx                 BadGatewayError 502
    refused, reset, closed mid-stream, not SSE,  BadGatewayError 502
      bad JSON, a stream that ends unfinished
    an error event inside a 200 stream           by its code/type as above (`stream_error`), else 502
    connect timeout, silence longer than the     GatewayTimeoutError 504
      gap, the job's deadline passed

Every wait (connect, response headers, each read) ends by the earliest of its own timeout and
the job's deadline, so a hanging upstream costs at most that long. A stream is closed, and
its connection dropped, whenever its reader stops early (aclose, cancellation, an error).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx

from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    TokenwayError,
    truncate,
)
from tokenway.routing.job import GenerationJob, Usage, estimate_tokens
from tokenway.routing.sse_decoder import SSEDecoder, SSEEvent
from tokenway.routing.upstream_errors import error_for_status

logger = logging.getLogger(__name__)

MAX_ERROR_BODY_BYTES = 64 * 1024
DRAIN_SECONDS = 1.0  # after the last event, how long to wait for the body's end to keep the connection

CountTokens = Callable[[GenerationJob, Sequence[str]], tuple[int, int]]
"""(job, one completion text per choice) -> (prompt_tokens, completion_tokens), by the model's tokenizer."""


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Seconds. Each is also cut short by the job's deadline, which bounds the whole call."""

    connect: float = 10.0
    first_event: float = 120.0  # request sent -> its first event: the upstream's queue and prefill
    between_events: float = 60.0  # the longest silence once events flow (an Anthropic ping counts)
    total: float | None = None  # the whole call, for jobs without a deadline
    probe: float = 3.0

    def __post_init__(self) -> None:
        for name in ("connect", "first_event", "between_events", "total", "probe"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 512  # each streaming call holds one for its whole length
    max_keepalive_connections: int = 64
    # Below uvicorn's 5 s keep-alive (vLLM, SGLang, tokenway): reusing a connection the upstream
    # is closing at that moment fails the call.
    keepalive_expiry: float = 4.0


def parse_json_object(name: str, data: str) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise BadGatewayError(f"Upstream {name} sent an event that is not a JSON object: {truncate(data, 60)!r}")
    return payload


# ---- usage an upstream did not report ---------------------------------------------------------------


def counted_usage(job: GenerationJob, completion_texts: Sequence[str], count_tokens: CountTokens | None) -> Usage:
    """The call's usage when the upstream reported none: the model's tokenizer where tokenway
    has it; else the templated prompt's length if the job carries it, or the job's estimate
    (GenerationJob.num_prompt_tokens), and estimate_tokens of each completion."""
    if count_tokens is not None:
        num_prompt_tokens, num_completion_tokens = count_tokens(job, completion_texts)
        return Usage(num_prompt_tokens, num_completion_tokens, counted_by="tokenizer")
    return Usage(job.num_prompt_tokens, sum(map(estimate_tokens, completion_texts)),
                 counted_by="estimate")


def api_key_from_env(api_key_env: str | None) -> str | None:
    """The key lives in the environment variable the config names; an unset one is a config error."""
    if api_key_env is None:
        return None
    api_key = os.environ.get(api_key_env, "").strip()
    if not api_key:
        raise ValueError(f"api_key_env: environment variable {api_key_env} is not set")
    return api_key


# ---- the HTTP side -------------------------------------------------------------------------------


class UpstreamHTTP:
    """One upstream's connection pool (keep-alive, bounded) and its two calls: a streamed POST
    read event by event, and a health probe. The client is made on first use and belongs to
    that event loop; aclose() closes every connection."""

    def __init__(self, name: str, base_url: str, headers: Mapping[str, str], timeouts: UpstreamTimeouts,
                 limits: ConnectionLimits, health_path: str = "models") -> None:
        self.name = name
        self.base_url = base_url.rstrip("/") + "/"
        self.timeouts = timeouts
        self._headers = dict(headers)  # may hold the api key: never logged, never in repr
        self._limits = limits
        self._health_path = health_path if "://" in health_path else health_path.lstrip("/")
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"UpstreamHTTP(name={self.name!r}, base_url={self.base_url!r})"

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = self._limits
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, follow_redirects=False,
                limits=httpx.Limits(max_connections=limits.max_connections, keepalive_expiry=limits.keepalive_expiry,
                                    max_keepalive_connections=limits.max_keepalive_connections))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def _within(self, make: Callable[[], Awaitable[Any]], until: float, deadline: float | None) -> Any:
        """Awaits make() until `until` (absolute monotonic), mapping timeouts and transport failures."""
        remaining = until - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                return await make()
        except (TimeoutError, httpx.TimeoutException):
            what = "before the request's deadline" if until == deadline else "in time"
            raise GatewayTimeoutError(f"Upstream {self.name} did not answer {what}.") from None
        except httpx.RequestError as exc:
            detail = truncate(str(exc), 120) or type(exc).__name__
            raise BadGatewayError(f"Upstream {self.name} failed: {detail}") from None

    async def stream_events(self, path: str, body: dict[str, Any], deadline: float | None,
                            is_last: Callable[[SSEEvent], bool]) -> AsyncIterator[SSEEvent]:
        """POSTs body and yields its events as they arrive; returns after the event is_last()
        accepts (draining the body's end so the connection is kept) or at the body's end.
        Closing this generator closes the response and its connection: the upstream sees it."""
        timeouts, started = self.timeouts, time.monotonic()
        if deadline is None and timeouts.total is not None:
            deadline = started + timeouts.total

        def bound(gap: float) -> float:  # when a wait ends: its own timeout or the deadline, whichever is first
            return min(time.monotonic() + gap, math.inf if deadline is None else deadline)

        client, event_by = self._http(), bound(timeouts.first_event)
        request = client.build_request(
            "POST", path, json=body,
            headers={"accept": "text/event-stream", "accept-encoding": "identity"},  # gzip would batch events
            timeout=httpx.Timeout(None, connect=max(0.001, min(timeouts.connect, event_by - started))))
        response = await self._within(lambda: client.send(request, stream=True), event_by, deadline)
        chunks: Any = None
        try:
            if response.status_code >= 300:
                raise await self._error(response, deadline)
            chunks, text = response.aiter_bytes(), codecs.getincrementaldecoder("utf-8")()
            sse = SSEDecoder()
            while (chunk := await self._within(lambda: anext(chunks, None), event_by, deadline)) is not None:
                try:
                    events = sse.feed(text.decode(chunk))
                except ValueError as exc:  # UnicodeDecodeError included
                    raise BadGatewayError(f"Upstream {self.name} sent a malformed event stream: {exc}") from None
                for event in events:
                    yield event
                    if is_last(event):
                        await self._drain(chunks, bound(DRAIN_SECONDS))
                        return
                    event_by = bound(timeouts.between_events)
            for event in sse.finish():
                yield event
        finally:
            if chunks is not None:
                await chunks.aclose()
            await response.aclose()

    async def _drain(self, chunks: AsyncIterator[bytes], until: float) -> None:
        """Reads to the body's end, so httpx can reuse the connection; the answer is already complete,
        so an upstream that lingers only loses the connection."""
        try:
            while await self._within(lambda: anext(chunks, None), until, None) is not None:
                pass
        except TokenwayError:
            pass

    async def _error(self, response: httpx.Response, deadline: float | None) -> TokenwayError:
        body = b""
        try:
            chunks = response.aiter_bytes()
            until = min(time.monotonic() + self.timeouts.between_events, deadline or math.inf)
            while len(body) < MAX_ERROR_BODY_BYTES and (chunk := await self._within(
                    lambda: anext(chunks, None), until, deadline)) is not None:
                body += chunk
        except TokenwayError:
            pass  # the status alone decides
        error = error_for_status(self.name, response.status_code, body[:MAX_ERROR_BODY_BYTES], response.headers)
        logger.warning("upstream %s answered HTTP %d -> %s", self.name, response.status_code, type(error).__name__)
        return error

    async def get_json(self, path: str, timeout: float) -> Any:
        """GET path within timeout: its JSON body, else the mapped error (the table above)."""
        client, until = self._http(), time.monotonic() + timeout
        response = await self._within(lambda: client.get(path, timeout=timeout), until, None)
        if response.status_code >= 300:
            raise error_for_status(self.name, response.status_code, response.content[:MAX_ERROR_BODY_BYTES],
                                   response.headers)
        try:
            return response.json()
        except ValueError:
            raise BadGatewayError(f"Upstream {self.name} answered GET {path} with something other than JSON.") from None

    async def probe(self) -> bool:
        """GET {base_url}/models (or the configured health path; a full URL is taken as is)
        within timeouts.probe: True if the upstream is up (health.Probe's contract), else
        raises the mapped error."""
        client, until = self._http(), time.monotonic() + self.timeouts.probe
        response = await self._within(lambda: client.get(self._health_path, timeout=self.timeouts.probe), until, None)
        if response.status_code >= 300:
            raise error_for_status(self.name, response.status_code, response.content[:MAX_ERROR_BODY_BYTES],
                                   response.headers)
        return True


class HTTPReplica:
    """What every replica reached over HTTP shares: its UpstreamHTTP client (`self.http`), the
    health probe, and closing the client's connections."""

    name: str
    http: UpstreamHTTP

    async def probe(self) -> bool:
        return await self.http.probe()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
