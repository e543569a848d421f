"""ResilientChat: chat calls and streams over resilience.Plan's attempts (see resilience.py for
the rules, streaming.py for what a stream returns), on openai.AsyncOpenAI clients (chat
completions) or anthropic.AsyncAnthropic ones (the Messages API: the request is its shape).

    chat = ResilientChat([openai.AsyncOpenAI(base_url=a), Endpoint(openai.AsyncOpenAI(base_url=b), model="m2")],
                         Policy(deadline=30, ttft_timeout=5))
    reply = await chat.create(model="m", messages=messages)
    async with await chat.stream(model="m", messages=messages) as stream:
        async for chunk in stream: print(chunk.choices[0].delta.content or "", end="")
    if not stream.result.complete:                       # it broke after its first token
        rest = await chat.stream(**stream.result.continue_request(request))
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from tokenway.client.resilience import DeadlineExceeded, Endpoint, FirstTokenTimeout, Plan, Policy
from tokenway.client.streaming import Accumulator, StreamResult
from tokenway.routing.health import CircuitBreaker


class StreamBroken(ConnectionError):
    """The stream ended without a finish_reason and without an error of its own (before its
    first token, a retryable attempt error)."""


class StreamClosed(Exception):
    """The caller closed the stream (or cancelled its task) before it ended."""


class ResilientChat:
    """`endpoints`: clients (or Endpoints: a client and the model to ask it for), preferred
    first. Their SDK retries are turned off: the attempts here are the only ones. `breakers`
    may be shared between ResilientChats, so all of them see an endpoint fail."""

    def __init__(self, endpoints: Sequence[Any], policy: Policy = Policy(),
                 breakers: dict[str, CircuitBreaker] | None = None) -> None:
        if not endpoints:
            raise ValueError("endpoints: give at least one")
        self.endpoints = tuple(_no_sdk_retries(e if isinstance(e, Endpoint) else Endpoint(e)) for e in endpoints)
        if len({hasattr(e.client, "messages") for e in self.endpoints}) > 1:
            raise ValueError("endpoints: all openai or all anthropic clients (the request's shape is one API's)")
        self.policy = policy
        self.breakers = {} if breakers is None else breakers

    def plan(self) -> Plan:
        return Plan(self.policy, self.endpoints, self.breakers)

    async def create(self, **request: Any) -> Any:
        """chat.completions.create(**request), non-streamed, with retries and failover."""
        if request.get("stream"):
            raise ValueError("create: for a stream, call stream()")
        plan = self.plan()
        while True:
            endpoint = await _next(plan)
            if endpoint is None:
                continue
            timeout = plan.timeout()
            try:
                async with asyncio.timeout(timeout):
                    reply = await _create(endpoint)(**endpoint.request(request), timeout=timeout)
            except asyncio.CancelledError:
                plan.abandoned(endpoint)
                raise
            except Exception as exc:
                plan.failed(endpoint, exc)
                continue
            plan.succeeded(endpoint)
            return reply

    async def stream(self, **request: Any) -> ResilientStream:
        """Opens a chat stream, retrying until its first token; returns it with that token in."""
        request = {**request, "stream": True}
        plan = self.plan()
        while True:
            endpoint = await _next(plan)
            if endpoint is None:
                continue
            started = time.monotonic()
            ttft = self.policy.ttft_timeout
            limit = ttft if ttft is not None and (self.policy.attempt_timeout is None
                                                   or ttft < self.policy.attempt_timeout) else None
            timeout = plan.timeout(limit)
            accumulator, head, sdk_stream = Accumulator(), [], None
            try:
                async with asyncio.timeout(timeout):
                    sdk_stream = await _create(endpoint)(**endpoint.request(request), timeout=timeout)
                    while not accumulator.has_token:  # a role-only chunk is not a token yet
                        chunk = await anext(sdk_stream, None)
                        if chunk is None:
                            raise StreamBroken(f"{endpoint.name}: the stream ended before its first token")
                        accumulator.add(chunk)
                        head.append(chunk)
            except asyncio.CancelledError:
                plan.abandoned(endpoint)
                await _close(sdk_stream)
                raise
            except Exception as exc:
                await _close(sdk_stream)
                if isinstance(exc, TimeoutError) and limit is not None and timeout == limit:
                    exc = FirstTokenTimeout(f"no first token from {endpoint.name} within {limit}s")
                plan.failed(endpoint, exc)
                continue
            plan.succeeded(endpoint)
            return ResilientStream(sdk_stream, head, accumulator, plan, endpoint, time.monotonic() - started)


def _create(endpoint: Endpoint) -> Any:
    """The SDK's call: the Messages API for an anthropic client, chat completions otherwise."""
    messages = getattr(endpoint.client, "messages", None)
    return messages.create if messages is not None else endpoint.client.chat.completions.create


async def _next(plan: Plan) -> Endpoint | None:
    """The next attempt's endpoint, after its wait; None if another call took its probe."""
    endpoint, delay = plan.next()
    if delay > 0:
        await asyncio.sleep(delay)
    return endpoint if plan.claim(endpoint) else None


def _no_sdk_retries(endpoint: Endpoint) -> Endpoint:
    return Endpoint(endpoint.client.with_options(max_retries=0), endpoint.model, endpoint.name)


async def _close(sdk_stream: Any) -> None:
    if sdk_stream is not None:
        await sdk_stream.close()


class ResilientStream:
    """The chunks of an opened stream. A break (the connection drops, an error event, the
    deadline) ends the iteration without raising; `result` then says what arrived and why it
    stopped. Leaving `async with`, close() or cancelling the task closes the connection."""

    def __init__(self, sdk_stream: Any, head: list[Any], accumulator: Accumulator, plan: Plan,
                 endpoint: Endpoint, ttft: float) -> None:
        self._sdk_stream = sdk_stream
        self._head = head
        self._accumulator = accumulator
        self._plan = plan
        self.endpoint = endpoint
        self.ttft = ttft
        self._error: BaseException | None = None
        self._done = False

    @property
    def attempts(self) -> tuple:
        """The failed attempts before this stream opened (resilience.Attempt)."""
        return tuple(self._plan.attempts)

    @property
    def result(self) -> StreamResult:
        """What arrived so far; final once the iteration ended."""
        return self._accumulator.result(self._error if self._done else StreamClosed("still streaming"),
                                        self.ttft, self.endpoint.name)

    def __aiter__(self) -> ResilientStream:
        return self

    async def __anext__(self) -> Any:
        if self._head:
            return self._head.pop(0)
        if self._done:
            raise StopAsyncIteration
        remaining = self._plan.remaining()
        try:
            async with asyncio.timeout(remaining):
                chunk = await anext(self._sdk_stream)
        except StopAsyncIteration:
            broken = self._accumulator.finish_reason is None
            await self._end(StreamBroken("the stream ended without a finish_reason") if broken else None)
            raise
        except asyncio.CancelledError:
            await self._end(StreamClosed("the task was cancelled"))
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError) and remaining is not None:
                exc = DeadlineExceeded(f"the deadline of {self._plan.policy.deadline}s passed mid-stream",
                                       self._plan.attempts)
            self._plan.breaker(self.endpoint).record_failure()
            await self._end(exc)
            raise StopAsyncIteration from None
        self._accumulator.add(chunk)
        return chunk

    async def final(self) -> StreamResult:
        """Reads the rest and returns the result."""
        async for _ in self:
            pass
        return self.result

    async def close(self) -> None:
        if not self._done:
            await self._end(StreamClosed("closed by the caller"))

    async def _end(self, error: BaseException | None) -> None:
        self._done, self._error = True, error
        self._head.clear()
        await self._sdk_stream.close()

    async def __aenter__(self) -> ResilientStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


class SyncResilientChat:
    """ResilientChat for synchronous code: the same attempts, run on an event loop in a thread
    of its own. Endpoints may be openai.OpenAI clients (an AsyncOpenAI with the same base
    URL, key and headers is made for each), anthropic.Anthropic ones, or their async kinds.

        chat = SyncResilientChat([openai.OpenAI(base_url=...)], Policy(deadline=30))
        reply = chat.create(model="m", messages=messages)
        with chat.stream(model="m", messages=messages) as stream:
            for chunk in stream: ...
        stream.result
    """

    def __init__(self, endpoints: Sequence[Any], policy: Policy = Policy(),
                 breakers: dict[str, CircuitBreaker] | None = None) -> None:
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenway-resilient", daemon=True)
        self._thread.start()
        self.chat = self._run(_make_async(endpoints, policy, breakers))

    def _run(self, coroutine: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C in the caller's thread: the attempt's connection is closed too
            raise

    def create(self, **request: Any) -> Any:
        return self._run(self.chat.create(**request))

    def stream(self, **request: Any) -> SyncResilientStream:
        return SyncResilientStream(self, self._run(self.chat.stream(**request)))

    def close(self) -> None:
        async def close_clients() -> None:
            for endpoint in self.chat.endpoints:
                await endpoint.client.close()

        self._run(close_clients())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> SyncResilientChat:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


async def _make_async(endpoints: Sequence[Any], policy: Policy,
                      breakers: dict[str, CircuitBreaker] | None) -> ResilientChat:
    """Made on the loop's thread: the async clients' connections belong to that loop."""
    import anthropic
    import openai

    def as_async(client: Any) -> Any:
        if isinstance(client, openai.OpenAI):
            return openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                                      organization=client.organization, project=client.project,
                                      default_headers=dict(client._custom_headers), timeout=client.timeout)
        if isinstance(client, anthropic.Anthropic):
            return anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key=client.api_key,
                                            auth_token=client.auth_token, timeout=client.timeout,
                                            default_headers=dict(client._custom_headers))
        return client

    return ResilientChat([Endpoint(as_async(e.client), e.model, e.name) if isinstance(e, Endpoint)
                          else as_async(e) for e in endpoints], policy, breakers)


class SyncResilientStream:
    def __init__(self, owner: SyncResilientChat, stream: ResilientStream) -> None:
        self._owner = owner
        self._stream = stream

    @property
    def result(self) -> StreamResult:
        return self._stream.result

    @property
    def attempts(self) -> tuple:
        return self._stream.attempts

    def __iter__(self) -> SyncResilientStream:
        return self

    def __next__(self) -> Any:
        try:
            return self._owner._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def final(self) -> StreamResult:
        return self._owner._run(self._stream.final())

    def close(self) -> None:
        self._owner._run(self._stream.close())

    def __enter__(self) -> SyncResilientStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
