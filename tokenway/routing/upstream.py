"""What every HTTP upstream replica shares: its pooled HTTP client (http_client.py), the event-stream reader
with its timers, the mapping of upstream failures onto tokenway's error tree, health probes.

    OpenAIUpstream / AnthropicUpstream / ResponsesUpstream ── body ─►
        streamed (sends_stream): UpstreamHTTP.stream_events(path, body, deadline) ─► SSEEvent ...
            (read as they arrive, timed, failures mapped)
        else: UpstreamHTTP.post_json(path, body, deadline) ─► one JSON object (the whole answer)
    ─► the protocol's own translation ─► ChoiceDelta ... Usage (the same events either way)

A caller that did not ask for a stream gets its upstream asked for none: one JSON body is a
fraction of the bytes, parses and syscalls of dozens of events (the first token's early arrival
is worth nothing to that caller). Logprobs keep the stream: top-20 logprobs make an answer
~1 KB a token, megabytes parsed whole on the loop every call shares.

What the caller sees when the upstream fails:

    upstream answer                              tokenway error            why
    400, 413, 422                                InvalidRequestError 400   the caller's request; upstream's
                                                                              message, param, code
    401, 403, 404, any other 3xx/4xx             BadGatewayError 502       tokenway's config is wrong;
                                                                              upstream's message withheld
    429                                          RateLimitError 429        retry-after / retry-after-ms passed on
    503, 529 (Anthropic's overloaded)            ServiceUnavailableError   retry-after passed on
    500, 502, 504, any other 5xx                 BadGatewayError 502
    refused, reset, closed mid-stream, not SSE,  BadGatewayError 502
      bad JSON, a stream or an answer that ends unfinished,
      a line or event over max_event_chars, a
      response head over 64 KiB, a JSON body
      over its cap
    an error event inside a 200 stream           by its code/type as above (`stream_error`), else 502
    connect timeout, silence longer than the     GatewayTimeoutError 504
      gap, a non-streamed answer not whole within
      whole_answer, the job's deadline passed

Every wait (connect, response headers, each read) ends by the earliest of its own timeout and
the job's deadline, so a hanging upstream costs at most that long. A stream is closed, and
its connection dropped, whenever its reader stops early (aclose, cancellation, an error).

What an upstream sends is bounded before it is parsed, since the parsing runs on the event
loop every call shares: a response head (64 KiB, http_client.py), one line or event of a
stream (ConnectionLimits.max_event_chars, 1 MiB: json.loads takes 0.3 ms for one long string,
13 ms for half a million small numbers), a non-streamed answer (ConnectionLimits.max_answer_bytes,
8 MiB: ~2M tokens of text; one json.loads of that much holds the loop 35 ms, 130 ms if it is
all escaped quotes, measured; an answer is rarely over 1 MiB), a JSON body read by GET
(max_bytes, 64 MiB: only a tokenway worker's tokenizer files need so much). Parsing in a thread
would not free the loop: json.loads holds the GIL for the whole call (20 MB of JSON: the loop
stalled 160 ms of the 160 ms parse, measured); what keeps the loop free is that each chunk is
looked at once (sse_decoder.py) and nothing larger than these caps is parsed.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import urlsplit

from tokenway.json_codec import dumps, loads
from tokenway.protocol.errors import (
    BadGatewayError,
    GatewayTimeoutError,
    TokenwayError,
    truncate,
)
from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage, estimate_tokens
from tokenway.protocol.sampling import EFFORT_BUDGETS, ThinkingRequest
from tokenway.routing.http_client import ConnectionPool, HTTPError, Response
from tokenway.routing.sse_decoder import MAX_EVENT_CHARS, EventTooLargeError, SSEDecoder, SSEEvent
from tokenway.routing.upstream_errors import error_for_status

logger = logging.getLogger(__name__)

MAX_ERROR_BODY_BYTES = 64 * 1024
MAX_JSON_BYTES = 64 * 2**20  # a worker's tokenizer files are the largest answer read whole
MAX_KNOWN_TARGETS = 64  # paths whose pool and request target are kept, not parsed again each call
_JSON_ANSWER = {"content-type": "application/json", "accept": "application/json"}
DRAIN_SECONDS = 1.0  # after the last event, how long to wait for the body's end to keep the connection

CountTokens = Callable[[GenerationJob, Sequence[str]], tuple[int, int]]
"""(job, one completion text per choice) -> (prompt_tokens, completion_tokens), by the model's tokenizer."""


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Seconds. Each is also cut short by the job's deadline, which bounds the whole call."""

    connect: float = 10.0
    first_event: float = 120.0  # request sent -> its first event: the upstream's queue and prefill
    between_events: float = 60.0  # the longest silence once events flow (an Anthropic ping counts)
    # request sent -> a non-streamed answer's last byte: queue, prefill and every token, with no
    # event between to tell a slow upstream from a hung one (OpenAI's SDK waits as long)
    whole_answer: float = 600.0
    total: float | None = None  # the whole call, for jobs without a deadline
    probe: float = 3.0

    def __post_init__(self) -> None:
        for name in ("connect", "first_event", "between_events", "whole_answer", "total", "probe"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """An upstream's connections, and how much of what it sends one call takes."""

    max_connections: int = 512  # each streaming call holds one for its whole length
    max_keepalive_connections: int = 64
    # Below uvicorn's 5 s keep-alive (vLLM, SGLang; tokenway's own is 20 s): reusing a
    # connection the upstream is closing at that moment fails the call.
    keepalive_expiry: float = 4.0
    # One line or event of a stream; over it the call ends with a 502 saying so. A token's
    # chunk is ~200 characters; one with top-20 logprobs a few thousand.
    max_event_chars: int = MAX_EVENT_CHARS
    # A non-streamed answer, read and parsed whole; over it the call ends with a 502 saying so.
    max_answer_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_keepalive_connections", "max_event_chars", "max_answer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")


def parse_json_object(name: str, data: str) -> dict[str, Any]:
    try:
        payload = loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the interpreter's stack
        payload = None
    if not isinstance(payload, dict):
        raise BadGatewayError(f"Upstream {name} sent an event that is not a JSON object: {truncate(data, 60)!r}")
    return payload


def sends_stream(job: GenerationJob) -> bool:
    """Whether the upstream is asked to stream: when the caller streams, or asked for logprobs
    (the module's docstring says why)."""
    return job.stream or job.params.logprobs is not None


def joined_delta(index: int, deltas: Iterable[ChoiceDelta | None]) -> ChoiceDelta:
    """Choice `index`'s deltas as one: a non-streamed answer read as the events its stream
    would have sent gives one delta for the choice, as the stream's would add up."""
    pieces = [delta for delta in deltas if delta is not None]
    logprobs = tuple(entry for delta in pieces for entry in delta.logprobs or ())
    return ChoiceDelta(index, text="".join(delta.text for delta in pieces),
                       reasoning="".join(delta.reasoning for delta in pieces),
                       tool_calls=tuple(call for delta in pieces for call in delta.tool_calls),
                       finish_reason=next((d.finish_reason for d in reversed(pieces) if d.finish_reason), None),
                       stop_reason=next((d.stop_reason for d in reversed(pieces) if d.stop_reason is not None), None),
                       logprobs=logprobs or None)


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


def sum_usages(usages: Sequence[Usage]) -> Usage:
    """One Usage for n calls (an upstream that takes one choice a call); counted_by is the least
    exact of theirs."""
    kinds = {u.counted_by for u in usages}
    counted_by = "estimate" if "estimate" in kinds else "tokenizer" if "tokenizer" in kinds else "replica"
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages),
                 reasoning_tokens=sum(u.reasoning_tokens for u in usages), counted_by=counted_by)


# ---- reasoning --------------------------------------------------------------------------------------


def reasoning_effort(thinking: ThinkingRequest | None) -> str | None:
    """What a ThinkingRequest asks in OpenAI's reasoning effort terms, for an upstream that takes
    those: "none" for thinking off; for a budget, the highest level whose budget
    (sampling.EFFORT_BUDGETS) fits in it, "minimal" below them all. None (send no effort: the
    model's default) when it asks nothing, or thinking on without a budget."""
    if thinking is None or thinking.enabled is None and thinking.budget_tokens is None:
        return None
    if thinking.enabled is False or thinking.budget_tokens == 0:
        return "none"
    if thinking.budget_tokens is None:
        return None
    fitting = [level for level, budget in EFFORT_BUDGETS.items() if 0 < budget <= thinking.budget_tokens]
    return fitting[-1] if fitting else "minimal"


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
    """One upstream's connection pool (keep-alive, bounded) and its calls: a streamed POST read
    event by event, a POST answered by one JSON object, a GET of JSON, and a health probe. The
    client is made on first use and belongs to that event loop; aclose() closes every connection."""

    def __init__(self, name: str, base_url: str, headers: Mapping[str, str], timeouts: UpstreamTimeouts,
                 limits: ConnectionLimits, health_path: str = "models") -> None:
        self.name = name
        self.base_url = base_url.rstrip("/") + "/"
        self.timeouts = timeouts
        self._headers = dict(headers)  # may hold the api key: never logged, never in repr
        self._limits = limits
        self._health_path = health_path if "://" in health_path else health_path.lstrip("/")
        self._pools: dict[str, ConnectionPool] = {}  # origin -> its connections
        self._targets: dict[str, tuple[ConnectionPool, str]] = {}  # path -> _target(path) (emptied with _pools)

    def __repr__(self) -> str:
        return f"UpstreamHTTP(name={self.name!r}, base_url={self.base_url!r})"

    def _target(self, path: str) -> tuple[ConnectionPool, str]:
        """The pool and request target of a path under base_url (or of a full URL)."""
        known = self._targets.get(path)
        if known is not None:
            return known
        parts = urlsplit(path if "://" in path else self.base_url + path)
        origin = f"{parts.scheme}://{parts.netloc}"
        pool = self._pools.get(origin)
        if pool is None:
            limits = self._limits
            pool = self._pools[origin] = ConnectionPool(
                origin, max_connections=limits.max_connections, max_keepalive=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry, connect_timeout=self.timeouts.connect)
        target = pool, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if len(self._targets) < MAX_KNOWN_TARGETS:
            self._targets[path] = target
        return target

    def _headers_with(self, headers: Mapping[str, str]) -> dict[str, str]:
        # identity: this client does not decompress, and a compressed stream would arrive in batches
        return {**self._headers, "accept-encoding": "identity", "user-agent": "tokenway", **headers}

    async def _request(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None,
                       until: float, deadline: float | None) -> Response:
        pool, target = self._target(path)
        headers = self._headers_with(headers)
        return await self._within(lambda: pool.request(method, target, headers, body), until, deadline)

    async def aclose(self) -> None:
        pools, self._pools, self._targets = self._pools, {}, {}
        for pool in pools.values():
            await pool.aclose()

    async def _within(self, make: Callable[[], Awaitable[Any]], until: float, deadline: float | None) -> Any:
        """Awaits make() until `until` (absolute monotonic), mapping timeouts and transport failures."""
        remaining = until - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                return await make()
        except TimeoutError:
            what = "before the request's deadline" if until == deadline else "in time"
            raise GatewayTimeoutError(f"Upstream {self.name} did not answer {what}.") from None
        except HTTPError as exc:
            detail = truncate(str(exc), 120) or type(exc).__name__
            raise BadGatewayError(f"Upstream {self.name} failed: {detail}") from None

    async def stream_events(self, path: str, body: dict[str, Any], deadline: float | None,
                            is_last: Callable[[SSEEvent], bool]) -> AsyncGenerator[SSEEvent, None]:
        """POSTs body and yields its events as they arrive; returns after the event is_last()
        accepts (draining the body's end so the connection is kept) or at the body's end.
        Closing this generator closes the response and its connection: the upstream sees it."""
        timeouts, started = self.timeouts, time.monotonic()
        if deadline is None and timeouts.total is not None:
            deadline = started + timeouts.total

        def bound(gap: float) -> float:  # when a wait ends: its own timeout or the deadline, whichever is first
            return min(time.monotonic() + gap, math.inf if deadline is None else deadline)

        event_by = bound(timeouts.first_event)
        response = await self._request(
            "POST", path, {"content-type": "application/json", "accept": "text/event-stream"},
            dumps(body), event_by, deadline)
        chunks: Any = None
        try:
            if response.status >= 300:
                raise await self._error(response, deadline)
            chunks, text = response.chunks(), codecs.getincrementaldecoder("utf-8")()
            sse = SSEDecoder(self._limits.max_event_chars)
            while (chunk := await self._within(lambda: anext(chunks, None), event_by, deadline)) is not None:
                try:
                    events = sse.feed(text.decode(chunk))
                except EventTooLargeError as exc:
                    raise BadGatewayError(f"Upstream {self.name} sent {exc}, more than one event may hold "
                                          f"(max_event_chars); the call was ended.") from None
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

    async def post_json(self, path: str, body: dict[str, Any], deadline: float | None) -> dict[str, Any]:
        """POSTs body and returns its answer, one JSON object read whole (at most
        limits.max_answer_bytes) by timeouts.whole_answer or the deadline, whichever is first.
        Cancelling it closes the response and its connection: the upstream sees it."""
        timeouts, started = self.timeouts, time.monotonic()
        if deadline is None and timeouts.total is not None:
            deadline = started + timeouts.total
        until = min(started + timeouts.whole_answer, math.inf if deadline is None else deadline)
        pool, target = self._target(path)
        headers, request_body = self._headers_with(_JSON_ANSWER), dumps(body)
        max_bytes = self._limits.max_answer_bytes

        async def answer() -> tuple[Response, bytes | None]:  # the request and its answer, under one timeout
            response = await pool.request("POST", target, headers, request_body)
            if response.status >= 300:
                return response, None  # an error: its body is read below, under an error's own time
            try:
                return response, await response.read(max_bytes + 1)
            finally:
                await response.aclose()

        response, data = await self._within(answer, until, deadline)
        if data is None:
            try:
                raise await self._error(response, deadline)
            finally:
                await response.aclose()
        if len(data) > max_bytes:
            raise BadGatewayError(f"Upstream {self.name} answered with more than {max_bytes} bytes "
                                  f"(max_answer_bytes); the call was ended.")
        try:
            payload = loads(data)
        except (ValueError, RecursionError):  # UnicodeDecodeError included
            payload = None
        if not isinstance(payload, dict):
            raise BadGatewayError(f"Upstream {self.name} answered with something other than a JSON object: "
                                  f"{truncate(data[:200].decode('utf-8', 'replace'), 60)!r}")
        return payload

    async def _drain(self, chunks: AsyncIterator[bytes], until: float) -> None:
        """Reads to the body's end, so the connection can be reused; the answer is already complete,
        so an upstream that lingers only loses the connection."""
        try:
            while await self._within(lambda: anext(chunks, None), until, None) is not None:
                pass
        except TokenwayError:
            pass

    async def _error(self, response: Response, deadline: float | None) -> TokenwayError:
        body = b""
        try:
            until = min(time.monotonic() + self.timeouts.between_events, deadline or math.inf)
            body = await self._within(lambda: response.read(MAX_ERROR_BODY_BYTES), until, deadline)
        except TokenwayError:
            pass  # the status alone decides
        error = error_for_status(self.name, response.status, body, response.headers)
        logger.warning("upstream %s answered HTTP %d -> %s", self.name, response.status, type(error).__name__)
        return error

    async def fetch(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None, until: float,
                    read_at_most: int) -> tuple[int, Mapping[str, str], bytes]:
        """One request answered whole by `until` (absolute monotonic), whatever its status: the
        status, headers and at most read_at_most bytes of body (ask one more than a cap to tell
        an answer over it). The response is closed after."""
        response = await self._request(method, path, headers, body, until, None)
        try:
            data = await self._within(lambda: response.read(read_at_most), until, None)
        finally:
            await response.aclose()
        return response.status, response.headers, data

    async def get_json(self, path: str, timeout: float, max_bytes: int = MAX_JSON_BYTES) -> Any:
        """GET path within timeout: its JSON body, else the mapped error (the table above)."""
        status, headers, body = await self.fetch("GET", path, {"accept": "application/json"}, None,
                                                 time.monotonic() + timeout, max_bytes + 1)
        if status >= 300:
            raise error_for_status(self.name, status, body[:MAX_ERROR_BODY_BYTES], headers)
        if len(body) > max_bytes:
            raise BadGatewayError(f"Upstream {self.name} answered GET {path} with more than {max_bytes} bytes.")
        try:
            return loads(body)
        except (ValueError, RecursionError):
            raise BadGatewayError(f"Upstream {self.name} answered GET {path} with something other than JSON.") from None

    async def probe(self) -> bool:
        """GET {base_url}/models (or the configured health path; a full URL is taken as is)
        within timeouts.probe: True if the upstream is up (health.Probe's contract), else
        raises the mapped error."""
        status, headers, body = await self.fetch("GET", self._health_path, {}, None,
                                                 time.monotonic() + self.timeouts.probe, MAX_ERROR_BODY_BYTES)
        if status >= 300:
            raise error_for_status(self.name, status, body, headers)
        return True


_END = object()


async def merge_streams(streams: Sequence[AsyncGenerator[ChoiceDelta, None]]) -> AsyncGenerator[ChoiceDelta, None]:
    """The streams' deltas in arrival order: n choices as n concurrent calls, for an upstream
    that makes one choice a call. The first failure, or the reader stopping, cancels every call
    (each closes its upstream response as it unwinds)."""
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)

    async def pump(stream: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    await queue.put(delta)
            await queue.put(_END)
        except Exception as exc:  # noqa: BLE001  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        num_ended = 0
        while num_ended < len(tasks):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _END:
                num_ended += 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def one_call_a_choice(calls: Sequence[AsyncGenerator[ChoiceDelta, None]],
                            usages: Callable[[], Sequence[Usage]]) -> AsyncGenerator[ChoiceDelta | Usage, None]:
    """A job's n choices from an upstream that makes one a call: the calls' deltas as they
    arrive (merge_streams; one call read directly), then one Usage, their usages summed, read
    once every call has ended."""
    async with aclosing(calls[0] if len(calls) == 1 else merge_streams(calls)) as deltas:
        async for delta in deltas:
            yield delta
    yield sum_usages(usages())


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
