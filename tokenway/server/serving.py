"""What every API route shares: the served model, admission, sampling parameters, the
context-window check, running n choices, and the per-request log line."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

from starlette.responses import JSONResponse, Response

from tokenway.engine.client import EngineClient, EngineDeadError
from tokenway.engine.request import SamplingParams, choice_params
from tokenway.engine.structured_output import StructuredOutputSpec
from tokenway.frontend.output import RequestOutput
from tokenway.frontend.tokenizer import PromptTooLong
from tokenway.gateway.auth import Principal
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.observability.observer import Observer
from tokenway.protocol.errors import (
    ContextLengthExceededError,
    InternalServerError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    TokenwayError,
)
from tokenway.routing.job import GenerationJob
from tokenway.server import sse
from tokenway.server.body_parser import BodyParser
from tokenway.server.call import Call, CallOutcome, RouteChoice
from tokenway.server.http import ClientDisconnected, unless_disconnected
from tokenway.stages import StageClock

access_log = logging.getLogger("tokenway.access")
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    # Requests allowed in flight (running + queued) before new ones get 503 + Retry-After.
    max_pending_requests: int = 256
    graceful_shutdown_seconds: float = 30.0
    admin_key: str | None = None  # guards /admin; None disables the admin API


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    config: ServerConfig
    model_names: tuple[str, ...]
    gatekeeper: Gatekeeper | None = None  # None: no auth, limits or ledger (benchmarks only)
    observer: Observer | None = None  # None: no traces, metrics or dashboard (--no-observability)
    body_parser: BodyParser = field(default_factory=BodyParser)
    created: int = field(default_factory=lambda: int(time.time()))
    num_pending: int = 0
    ready: bool = True

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def resolve_model(self, name: str | None, principal: Principal | None = None) -> str:
        """The served name a request's `model` refers to; 404 for anything else, 403 for a
        model the caller's key may not use."""
        if name not in self.model_names:
            raise NotFoundError.for_model(str(name))
        if principal is not None and self.gatekeeper is not None:
            self.gatekeeper.check_model(principal, name)
        return name

    def route(self, body, call: Call) -> str:
        """Stage 2: the served model for a generation call (the local engine, for now)."""
        name = self.resolve_model(body.model, call.start.principal)
        call.set_route(RouteChoice(model=name, pool=name, replica="local", reason="only"))
        call.clock.end("routing")
        return name

    def max_tokens(self, call: Call, num_prompt_tokens: int, requested: int | None, param: str,
                   num_messages: int = 1) -> int:
        """max_tokens after the window check and the key's caps (the cap fills in when the
        request names none)."""
        if self.gatekeeper is not None:
            principal = call.start.principal
            self.gatekeeper.check_sizes(principal, num_messages, requested, param)
            cap = self.gatekeeper.max_tokens_cap(principal)
            if requested is None and cap is not None:
                requested = min(cap, self.max_model_len - num_prompt_tokens)
        return resolve_max_tokens(self, num_prompt_tokens, requested, param)

    async def admit(self, generation: "Generation") -> None:
        """Budget and limits, reserving prompt + max_tokens for every choice. Raises 429."""
        call, job = generation.call, generation.job
        if self.gatekeeper is not None:
            reserve = len(job.prompt_token_ids) + (job.params.max_tokens or 0) * job.n
            call.set_admission(await self.gatekeeper.admit(call.start.principal, reserve))
        call.clock.end("limits")

    async def prepare(self, request, prepare: Callable[..., Any], *args: Any) -> Any:
        """Run a route's prepare step (chat template, tokenizing, the checks that need the
        model): where it is for a small body; for a large one in a worker thread, where the
        tokenizer runs without the GIL, so the event loop keeps serving meanwhile."""
        if request.scope["state"]["body_bytes"] <= self.body_parser.inline_bytes:
            return prepare(*args)
        return await asyncio.to_thread(prepare, *args)

    def engine_stats(self) -> dict:
        """A snapshot of the engine: what runs, what waits, how full the KV cache is."""
        return {**self.engine.stats(), "num_pending_http": self.num_pending}

    def take_engine_slots(self, count: int = 1) -> None:
        if self.num_pending + count > self.config.max_pending_requests:
            raise ServiceUnavailableError(
                f"The server is at capacity ({self.num_pending} requests in flight); retry shortly.",
                retry_after=1,
            )
        self.num_pending += count

    def release_engine_slots(self, count: int = 1) -> None:
        self.num_pending -= count


@contextmanager
def context_window(state: ServerState, param: str) -> Iterator[int]:
    """Tokenize inside this: yields the window to pass as max_num_tokens, and turns a prompt
    known to exceed it (without tokenizing it all) into the context-length 400."""
    try:
        yield state.max_model_len
    except PromptTooLong as exc:
        raise ContextLengthExceededError(exc.num_tokens_at_least, None, state.max_model_len, param=param,
                                         at_least=True) from None


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def resolve_max_tokens(state: ServerState, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
    """OpenAI's rule: prompt + max_tokens must fit the window; no max_tokens means 'the rest'."""
    window = state.max_model_len
    if num_prompt_tokens >= window:
        raise ContextLengthExceededError(num_prompt_tokens, max_tokens, window, param="messages")
    if max_tokens is None:
        return window - num_prompt_tokens
    if num_prompt_tokens + max_tokens > window:
        raise ContextLengthExceededError(num_prompt_tokens, max_tokens, window, param=param)
    return max_tokens


def structured_output_spec(json_schema: dict | None, json_object: bool) -> StructuredOutputSpec | None:
    if json_schema is not None:
        return StructuredOutputSpec.json_schema(json_schema)  # keeps the user's property order
    if json_object:
        return StructuredOutputSpec(kind="json_object")
    return None


def make_sampling_params(body: Any, max_tokens: int, structured: StructuredOutputSpec | None,
                         logprobs: int | None, stop: Any) -> SamplingParams:
    """Map the OpenAI fields onto SamplingParams; a ValueError there names the field."""
    logit_bias = None
    if getattr(body, "logit_bias", None):
        try:
            logit_bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias: keys must be token ids", param="logit_bias") from None
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=getattr(body, "top_k", None) or 0,
            min_p=getattr(body, "min_p", None) or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=getattr(body, "repetition_penalty", None) or 1.0,
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            min_tokens=getattr(body, "min_tokens", None) or 0,
            stop=tuple(s for s in (stop or ()) if s),
            stop_token_ids=tuple(getattr(body, "stop_token_ids", None) or ()),
            ignore_eos=bool(getattr(body, "ignore_eos", False)),
            logprobs=logprobs,
            structured_output=structured,
        )
    except ValueError as exc:
        field_name = str(exc).split(":", 1)[0]
        raise InvalidRequestError(str(exc), param=field_name) from None


async def run_choices(
    state: ServerState, request_id: str, prompt_token_ids: list[int], params_list: list[SamplingParams]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run the choices as engine requests and merge their outputs as they come. Leaving
    early (a disconnect, an error) aborts every one of them."""
    if len(params_list) == 1:
        async for output in state.engine.generate(prompt_token_ids, params_list[0], request_id):
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, params: SamplingParams) -> None:
        try:
            async for output in state.engine.generate(prompt_token_ids, params, f"{request_id}-{index}"):
                await merged.put((index, output))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await merged.put((index, exc))
            return
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params_list)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def mark_engine_times(clock: StageClock, output: RequestOutput) -> None:
    """Queue ends when the engine first schedules the request, prefill at its first token,
    decode at its last (over all choices: the first to start, the last to finish)."""
    metrics = output.metrics
    if metrics is None:
        return
    if metrics.first_scheduled_time is not None and not clock.ended("queue"):
        clock.end("queue", metrics.first_scheduled_time)
    if metrics.first_token_time is not None and not clock.ended("prefill"):
        clock.end("prefill", metrics.first_token_time)
    if metrics.last_token_time is not None:
        clock.end("decode", max(metrics.last_token_time, clock.ends.get("decode", 0.0)))


def log_request(request_id: str, model: str, clock: StageClock, outcome: CallOutcome) -> None:
    access_log.info(json.dumps({
        "request_id": request_id,
        "model": model,
        "status": outcome.status,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "completion_tokens": outcome.completion_tokens,
        "finish_reason": outcome.finish_reason,
        "error": outcome.error,
        "ttft_ms": None if clock.ttft_ms is None else round(clock.ttft_ms, 2),
        "stages_ms": {k: round(v, 2) for k, v in clock.durations_ms().items()},
    }))


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def engine_unavailable() -> ServiceUnavailableError:
    return ServiceUnavailableError("The engine is restarting; retry shortly.", retry_after=1,
                                   code="engine_unavailable")


class Generation:
    """One API call's engine work: the job, its choices' running counts, the log line, and the
    call's outcome when it ends."""

    def __init__(self, state: ServerState, call: Call, job: GenerationJob) -> None:
        self.state = state
        self.call = call
        self.clock = call.clock
        self.job = job
        self.model = job.model
        self.request_id = job.request_id
        self.prompt_token_ids = list(job.prompt_token_ids)
        self.params_list = choice_params(job.params, job.n)
        self.num_choices = job.n
        call.set_job(job)  # from here a 400 or 429 is billed with the job's prompt
        # The engine's own checks (vocabulary, window, a response_format that cannot be
        # satisfied) run now, so they are a 400 before any byte of a stream is sent.
        try:
            state.engine.validate_prompt(self.prompt_token_ids, job.params)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=str(exc).split(":", 1)[0]) from None
        except EngineDeadError:
            raise engine_unavailable() from None
        self.completion_tokens = [0] * self.num_choices
        self.finish_reasons: list[str | None] = [None] * self.num_choices
        self.num_cached_tokens = 0
        self.cache_reason: str | None = None
        call.clock.end("tokenize")

    async def outputs(self):
        self.state.take_engine_slots(self.num_choices)
        observer = self.state.observer
        last_token_times: list[float | None] = [None] * self.num_choices
        try:
            async for index, output in run_choices(self.state, self.request_id, self.prompt_token_ids,
                                                   self.params_list):
                mark_engine_times(self.clock, output)
                completion = output.outputs[0]
                num_new = len(completion.token_ids) - self.completion_tokens[index]
                if observer is not None and num_new > 0:
                    now, previous = output.metrics.last_token_time, last_token_times[index]
                    observer.on_tokens(self.model, num_new, None if previous is None else (now - previous) / num_new)
                    last_token_times[index] = now
                self.completion_tokens[index] = len(completion.token_ids)
                if output.num_cached_tokens >= self.num_cached_tokens:
                    self.num_cached_tokens, self.cache_reason = output.num_cached_tokens, output.cache_reason
                if completion.finish_reason is not None:
                    self.finish_reasons[index] = completion.finish_reason
                yield index, output
        except TokenwayError:
            raise
        except EngineDeadError as exc:
            if not any(self.completion_tokens):  # refused before it ran: the caller may retry
                raise engine_unavailable() from exc
            raise InternalServerError("The engine stopped while generating this request.") from exc
        except Exception as exc:
            # The engine failed this step (its thread logged the traceback): a plain 500.
            raise InternalServerError("The engine failed while generating this request.") from exc
        finally:
            self.state.release_engine_slots(self.num_choices)

    async def final_outputs(self) -> list:
        """Run to the end; the finished CompletionOutput of each choice, by index."""
        finals = {}
        async for index, output in self.outputs():
            if output.finished:
                finals[index] = output.outputs[0]
        return [finals[index] for index in range(self.num_choices)]

    async def commit(self) -> None:
        """Make the ledger row durable; a stream calls this before its final event."""
        if self.state.gatekeeper is not None:
            await self.state.gatekeeper.commit(self.call)

    async def json_response(self, request, work, id_header: str = "x-request-id"):
        """Await the response body unless the client leaves first; log and time it either way."""
        try:
            body = await unless_disconnected(request, work)
        except ClientDisconnected:
            self.finish(499, "client disconnected")
            return Response(status_code=499)
        except TokenwayError as exc:
            self.finish(exc.status, exc.message)
            raise
        self.clock.end("postprocess")
        response = JSONResponse(body, headers={"Server-Timing": self.clock.server_timing(), id_header: self.request_id})
        self.finish()
        return response

    def usage(self) -> dict:
        return usage_dict(len(self.prompt_token_ids), sum(self.completion_tokens), self.num_cached_tokens)

    def finish(self, status: int = 200, error: str | None = None) -> None:
        """The call's outcome, made once from the counts as they stand, and its log line."""
        reasons = [r for r in self.finish_reasons if r]
        outcome = CallOutcome(
            status, prompt_tokens=len(self.prompt_token_ids), cached_tokens=self.num_cached_tokens,
            completion_tokens=sum(self.completion_tokens), max_choice_tokens=max(self.completion_tokens),
            finish_reason=reasons[0] if reasons else None, error=error, cache_reason=self.cache_reason)
        self.call.end(outcome)
        log_request(self.request_id, self.model, self.clock, outcome)


STREAM_FAILED = "The server failed while generating; the stream has ended."


async def framed_stream(events: AsyncIterator[bytes], generation: Generation,
                        render_error: Callable[[TokenwayError], list[bytes]],
                        closing: list[bytes]) -> AsyncIterator[bytes]:
    """Frame an API's stream events, the same for every API: an error after the stream began
    ends it with the API's error event(s), never a silent cut; the stage times go in an SSE
    comment (clients ignore it); the ledger row is durable before the closing event(s); a
    disconnect (cancellation) bills what was generated."""
    try:
        async for event in events:
            yield event
    except TokenwayError as exc:
        error, reason = exc, exc.message
    except Exception as exc:  # noqa: BLE001 - reported to the client, logged in full
        logger.exception("stream %s failed", generation.request_id)
        error, reason = InternalServerError(STREAM_FAILED, code="internal_error"), type(exc).__name__
    except BaseException:
        generation.finish(499, "client disconnected")
        raise
    else:
        generation.clock.end("postprocess")
        yield sse.comment("server-timing: " + generation.clock.server_timing())
        generation.finish()
        await generation.commit()
        for event in closing:
            yield event
        return
    generation.finish(error.status, reason)
    await generation.commit()
    for event in render_error(error):
        yield event
