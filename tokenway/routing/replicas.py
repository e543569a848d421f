"""The Replica interface, and the local engine as one replica among others.

    Replica           name, kind; generate(job) -> ReplicaEvents; probe(); stats(); aclose()
    ├── LocalReplica       this process's engine (engine/client.py's EngineClient: the engine
    │                      process or thread); runs a job's n choices as n engine requests
    ├── WorkerReplica      a `tokenway worker` on another host (routing/worker_replica.py)
    ├── OpenAIUpstream     any OpenAI-compatible server (routing/openai_upstream.py)
    └── AnthropicUpstream  an Anthropic Messages server (routing/anthropic_upstream.py)

Every replica answers a job the same way: ChoiceDeltas as the choices release text, then one
Usage. Closing the iterator early (the client left, the deadline passed) aborts the work on the
replica. Failures are TokenwayErrors; upstream.is_replica_fault says which count against the
replica's health.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Protocol

from tokenway.engine.client import EngineClient, EngineDeadError
from tokenway.engine.stats import EngineStats
from tokenway.frontend.output import RequestOutput
from tokenway.protocol.errors import InternalServerError, ServiceUnavailableError, invalid_value
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, ServiceClass, Usage
from tokenway.protocol.sampling import SamplingParams, choice_params


class Replica(Protocol):
    name: str
    kind: str  # "engine", "worker", "openai", "anthropic", "responses"

    def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]: ...

    async def probe(self) -> bool: ...

    def stats(self) -> EngineStats | None:
        """The counts of the tokenway engine the replica runs on, as of its last read (no I/O);
        None where it publishes none (an upstream, a worker not probed yet)."""
        ...

    async def aclose(self) -> None: ...


class LocalReplica:
    """The engine of this process. Jobs come templated (prompt_token_ids): the gateway holds
    the same tokenizer as the engine."""

    kind = "engine"

    def __init__(self, engine: EngineClient, name: str = "local") -> None:
        self.engine = engine
        self.name = name

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        assert job.prompt_token_ids is not None, "the local engine runs templated jobs"
        prompt_token_ids = list(job.prompt_token_ids)
        num_completion_tokens = [0] * job.n
        num_cached_tokens, cache_reason = 0, None
        # A batch line takes its reply whole and is billed no output unless it ends (a line
        # cancelled is charged none, as OpenAI's Batch API charges), so its reply crosses whole,
        # once. An interactive call's tokens cross as they come even unstreamed: one cancelled or
        # timed out is billed the tokens computed, which only the deltas it saw count.
        final_only = not job.stream and job.service_class == "batch"
        choices = run_choices(self.engine, job.request_id, prompt_token_ids, choice_params(job.params, job.n),
                              job.service_class, final_only=final_only)
        try:
            async with aclosing(choices):
                async for index, output in choices:
                    delta = choice_delta(index, output)
                    num_completion_tokens[index] += len(delta.token_ids)
                    if delta.num_cached_tokens >= num_cached_tokens:
                        num_cached_tokens, cache_reason = delta.num_cached_tokens, delta.cache_reason
                    yield delta
        except EngineDeadError as exc:
            if not any(num_completion_tokens):  # refused before it ran: another replica, or a retry, may take it
                raise engine_unavailable() from exc
            raise InternalServerError("The engine stopped while generating this request.") from exc
        except ValueError as exc:  # what the engine refused (the server checks first: a race, rarely)
            raise invalid_value(exc) from None
        except Exception as exc:
            # The engine failed this step (it logged the traceback): a plain 500.
            raise InternalServerError("The engine failed while generating this request.") from exc
        yield Usage(len(prompt_token_ids), sum(num_completion_tokens), num_cached_tokens, cache_reason=cache_reason)

    async def probe(self) -> bool:
        return self.engine.is_alive

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def aclose(self) -> None:
        pass  # the server shuts the engine down itself, after the last request


def engine_unavailable() -> ServiceUnavailableError:
    """The local engine is down (restarting): the caller may retry shortly."""
    return ServiceUnavailableError("The engine is restarting; retry shortly.", retry_after=1,
                                   code="engine_unavailable")


def choice_delta(index: int, output: RequestOutput) -> ChoiceDelta:
    """What one engine output released, as a replica event."""
    completion = output.outputs[0]
    new_token_ids = completion.delta_token_ids
    logprobs = None
    if completion.logprobs is not None:
        logprobs = tuple(completion.logprobs[len(completion.logprobs) - len(new_token_ids):])
    metrics = output.metrics
    return ChoiceDelta(
        index, text=completion.delta_text, token_ids=tuple(new_token_ids),
        finish_reason=completion.finish_reason if output.finished else None,
        stop_reason=completion.stop_reason if output.finished else None, logprobs=logprobs,
        num_cached_tokens=output.num_cached_tokens, cache_reason=output.cache_reason,
        engine_times=None if metrics is None else (metrics.first_scheduled_time, metrics.first_token_time,
                                                   metrics.last_token_time))


async def run_choices(engine: EngineClient, request_id: str, prompt_token_ids: list[int],
                      params_list: list[SamplingParams], service_class: ServiceClass = "default",
                      final_only: bool = False) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) of the call's engine requests, as they come (final_only: each
    request's last only, its delta the whole: EngineClient.generate). Closing this (or an
    error) closes every request's generator, which aborts it in the engine."""
    if len(params_list) == 1:
        async with aclosing(engine.generate(prompt_token_ids, params_list[0], request_id,
                                            service_class=service_class, final_only=final_only)) as outputs:
            async for output in outputs:
                yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, params: SamplingParams) -> None:
        try:
            async with aclosing(engine.generate(prompt_token_ids, params, f"{request_id}-{index}",
                                                service_class=service_class, final_only=final_only)) as outputs:
                async for output in outputs:
                    merged.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait((index, exc))
            return
        merged.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(index, params)) for index, params in enumerate(params_list)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await merged.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
