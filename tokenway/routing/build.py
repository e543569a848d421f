"""The registry's chat models as pools `tokenway serve` routes to.

    Registry (the config file) ─► per chat model: its replicas (LocalReplica, WorkerReplica,
        OpenAIUpstream, AnthropicUpstream, ResponsesUpstream), their breakers and active probes,
        its Balancer
        ─► Pool ─► Router (with the fallback chain)
    and per model the ModelFrontend its jobs are templated with: the local engine's, or one
    built from the tokenizer files a worker of the pool sends (workers run token ids only).

A pool of upstreams only has no frontend: tokenway has no tokenizer for it, so its jobs go
untemplated (the messages; the upstream templates and counts them) and its window is the
config's context_window. A pool that has a frontend counts with it what an upstream of the
pool does not report. Jobs are templated once, for the model asked for, so a templated pool
may fall back to one with the same tokenizer or to an untemplated one (chat jobs always carry
the messages too), and an untemplated pool only to untemplated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenway.engine.client import EngineClient
from tokenway.frontend.model import ModelFrontend
from tokenway.protocol.errors import TokenwayError
from tokenway.protocol.job import GenerationJob
from tokenway.routing.anthropic_upstream import AnthropicUpstream
from tokenway.routing.openai_upstream import OpenAIUpstream
from tokenway.routing.registry import Registry
from tokenway.routing.registry_config import ModelEntry, ReplicaSpec
from tokenway.routing.replicas import LocalReplica, Replica
from tokenway.routing.responses_upstream import ResponsesUpstream
from tokenway.routing.router import Pool, Router
from tokenway.routing.upstream import CountTokens
from tokenway.routing.worker_replica import WorkerReplica


@dataclass(frozen=True, slots=True)
class Routes:
    router: Router
    frontends: dict[str, ModelFrontend]  # served name -> its frontend; untemplated models have none
    context_windows: dict[str, int]  # served name -> its window, every chat model


async def build_router(registry: Registry, engine: EngineClient | None, *, max_pending_requests: int,
                       cache_dir: Path) -> Routes:
    """Every chat model's pool. Raises ValueError for what cannot be served (a worker pool
    none of whose workers answers with its tokenizer, a fallback that could not run the
    model's jobs, a local replica without an engine)."""
    pools: dict[str, Pool] = {}
    frontends: dict[str, ModelFrontend] = {}
    windows: dict[str, int] = {}
    for entry in registry.models:
        if entry.kind != "chat":
            continue
        templated = [_templated_replica(entry, spec, engine) for spec in entry.replicas
                     if spec.kind in ("local", "worker")]
        frontend = await _frontend(entry, templated, cache_dir) if templated else None
        if frontend is not None:
            # A conversation comes back longer on every turn: its earlier turns' ids are kept.
            frontend.tokenizer.enable_segment_cache()
        count_tokens = _token_counter(frontend) if frontend is not None else None
        replicas = iter(templated)
        pool: list[Replica] = [
            next(replicas) if spec.kind in ("local", "worker") else _upstream(entry, spec, count_tokens)
            for spec in entry.replicas]
        pools[entry.name] = _pool(entry, pool, max_pending_requests)
        if frontend is not None:
            frontends[entry.name] = frontend
            windows[entry.name] = frontend.max_model_len
        else:
            assert entry.context_window is not None, "ModelEntry requires the window of a model with upstreams"
            windows[entry.name] = entry.context_window
    for name in pools:
        for fallback in registry.fallback_chain(name)[1:]:
            if fallback.name not in pools:
                continue
            ours, theirs = frontends.get(name), frontends.get(fallback.name)
            if ours is None and theirs is not None:
                raise ValueError(f"models: {name} falls back to {fallback.name}, which runs templated prompts; "
                                 f"{name} has no tokenizer in tokenway (its replicas are upstreams), so its calls "
                                 "could not run there")
            if ours is not None and theirs is not None and not _same_tokenizer(ours, theirs):
                raise ValueError(f"models: {name} falls back to {fallback.name}, whose tokenizer differs; a fallback "
                                 "must share its model's tokenizer (prompts are templated once), or be upstreams")
    router = Router(pools, fallback_chain=lambda name: tuple(
        e.name for e in registry.fallback_chain(name) if e.name in pools))
    return Routes(router, frontends, windows)


def _templated_replica(entry: ModelEntry, spec: ReplicaSpec, engine: EngineClient | None
                       ) -> LocalReplica | WorkerReplica:
    if spec.kind == "local":
        if engine is None:
            raise ValueError(f"models: {entry.name}: a local replica needs this server's engine")
        return LocalReplica(engine, spec.name)
    assert spec.url is not None, "ReplicaSpec requires a worker's url"
    return WorkerReplica(spec.name, spec.url, spec.secret_env, timeouts=entry.upstream_timeouts())


UPSTREAM_CLASSES = {"openai": OpenAIUpstream, "anthropic": AnthropicUpstream, "responses": ResponsesUpstream}


def _upstream(entry: ModelEntry, spec: ReplicaSpec, count_tokens: CountTokens | None
              ) -> OpenAIUpstream | AnthropicUpstream | ResponsesUpstream:
    assert spec.url is not None and spec.model is not None, "ReplicaSpec requires an upstream's url and model"
    kind = UPSTREAM_CLASSES[spec.kind]
    return kind(spec.name, spec.url, spec.model, spec.api_key_env, timeouts=entry.upstream_timeouts(),
                count_tokens=count_tokens)


def _token_counter(frontend: ModelFrontend) -> CountTokens:
    """Usage an upstream did not report, by the pool's tokenizer: the templated prompt, and
    each choice's text re-encoded."""
    tokenizer = frontend.tokenizer

    def count(job: GenerationJob, completion_texts: Sequence[str]) -> tuple[int, int]:
        return job.num_prompt_tokens, sum(len(tokenizer.encode(text, add_special_tokens=False))
                                          for text in completion_texts)

    return count


def local_max_in_flight(max_pending_requests: int) -> int:
    """The local engine's balancer cap: the server's own (server/services.py Capacity), which
    admits that many interactive calls and, apart, that many batch lines. Batch lines queued
    deep in the engine must leave every interactive call its slot, not hold it in the pool's
    queue until they end."""
    return 2 * max_pending_requests


def _pool(entry: ModelEntry, replicas: list[Replica], max_pending_requests: int) -> Pool:
    max_in_flight = dict(entry.name_to_max_in_flight)
    for replica in replicas:  # the local engine's own cap is the server's
        if isinstance(replica, LocalReplica):
            max_in_flight.setdefault(replica.name, local_max_in_flight(max_pending_requests))
    return Pool.of(entry.name, replicas, entry.balancer, entry.breaker, entry.health, max_in_flight)


async def _frontend(entry: ModelEntry, replicas: list[LocalReplica | WorkerReplica], cache_dir: Path
                    ) -> ModelFrontend:
    """The local engine's where the pool has the local replica; else one from the tokenizer
    files of the first of its workers that sends them."""
    local = next((r for r in replicas if isinstance(r, LocalReplica)), None)
    if local is not None:
        return local.engine.frontend
    errors = []
    for worker in (r for r in replicas if isinstance(r, WorkerReplica)):
        try:
            model_dir = await worker.fetch_tokenizer(cache_dir)
            window = entry.context_window or (await worker.state()).get("max_model_len")
            return ModelFrontend.from_dir(model_dir, window)
        except (TokenwayError, OSError, ValueError) as exc:
            errors.append(f"{worker.name}: {getattr(exc, 'message', exc)}")
    raise ValueError(f"models: {entry.name}: no worker sent its tokenizer ({'; '.join(errors)})")


def _same_tokenizer(a: ModelFrontend, b: ModelFrontend) -> bool:
    return a is b or (a.vocab_size == b.vocab_size and a.tokenizer.hf.to_str() == b.tokenizer.hf.to_str())
