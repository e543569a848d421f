"""The registry's chat models as pools `tokenway serve` routes to.

    Registry (the config file) ─► per chat model: its replicas (LocalReplica, WorkerReplica),
        their breakers and active probes, its Balancer ─► Pool ─► Router (with the fallback chain)
    and per model the ModelFrontend its jobs are templated with: the local engine's, or one
    built from the tokenizer files a worker of the pool sends (workers run token ids only).

Served today: local and worker replicas. OpenAI- and Anthropic-compatible replicas are parsed
and built (routing/openai_upstream.py, anthropic_upstream.py) but their untemplated path
through the API adaptors is not wired yet: a config naming one is refused at start, clearly.
A fallback must share its model's tokenizer (the job's prompt ids are templated once).
"""

from __future__ import annotations

from pathlib import Path

from tokenway.engine.client import EngineClient
from tokenway.frontend.model import ModelFrontend
from tokenway.protocol.errors import TokenwayError
from tokenway.routing.registry import Registry
from tokenway.routing.registry_config import ModelEntry
from tokenway.routing.replicas import LocalReplica, Replica
from tokenway.routing.router import Pool, Router
from tokenway.routing.worker_replica import WorkerReplica


async def build_router(registry: Registry, engine: EngineClient, *, max_pending_requests: int,
                       cache_dir: Path) -> tuple[Router, dict[str, ModelFrontend]]:
    """(the router, served name -> its frontend) for every chat model. Raises ValueError for
    what cannot be served (an upstream replica kind not wired yet, a worker pool none of whose
    workers answers with its tokenizer, a fallback with another tokenizer)."""
    pools: dict[str, Pool] = {}
    frontends: dict[str, ModelFrontend] = {}
    for entry in registry.models:
        if entry.kind != "chat":
            continue
        replicas = [_replica(entry, spec, engine) for spec in entry.replicas]
        pools[entry.name] = _pool(entry, replicas, max_pending_requests)
        frontends[entry.name] = await _frontend(entry, replicas, engine, cache_dir)
    for name, frontend in frontends.items():
        for fallback in registry.fallback_chain(name)[1:]:
            if fallback.name in frontends and not _same_tokenizer(frontend, frontends[fallback.name]):
                raise ValueError(f"models: {name} falls back to {fallback.name}, whose tokenizer differs; a fallback "
                                 "must share its model's tokenizer (prompts are templated once)")
    router = Router(pools, fallback_chain=lambda name: tuple(
        e.name for e in registry.fallback_chain(name) if e.name in pools))
    return router, frontends


def _replica(entry: ModelEntry, spec, engine: EngineClient) -> Replica:
    if spec.kind == "local":
        return LocalReplica(engine, spec.name)
    if spec.kind == "worker":
        return WorkerReplica(spec.name, spec.url, spec.secret_env, timeouts=entry.upstream_timeouts())
    raise ValueError(f"models: {entry.name}: {spec.kind} replicas are not routed by tokenway serve yet "
                     "(tokenway workers and the local engine are)")


def _pool(entry: ModelEntry, replicas: list[Replica], max_pending_requests: int) -> Pool:
    max_in_flight = dict(entry.name_to_max_in_flight)
    for replica in replicas:  # the local engine's own cap is the server's
        if isinstance(replica, LocalReplica):
            max_in_flight.setdefault(replica.name, max_pending_requests)
    return Pool.of(entry.name, replicas, entry.balancer, entry.breaker, entry.health, max_in_flight)


async def _frontend(entry: ModelEntry, replicas: list[Replica], engine: EngineClient,
                    cache_dir: Path) -> ModelFrontend:
    if any(isinstance(r, LocalReplica) for r in replicas):
        return engine.frontend
    errors = []
    for worker in replicas:
        try:
            model_dir = await worker.fetch_tokenizer(cache_dir)
            window = entry.context_window or (await worker.state()).get("max_model_len")
            return ModelFrontend.from_dir(model_dir, window)
        except (TokenwayError, OSError, ValueError) as exc:
            errors.append(f"{worker.name}: {getattr(exc, 'message', exc)}")
    raise ValueError(f"models: {entry.name}: no worker sent its tokenizer ({'; '.join(errors)})")


def _same_tokenizer(a: ModelFrontend, b: ModelFrontend) -> bool:
    return a is b or (a.vocab_size == b.vocab_size and a.tokenizer.hf.to_str() == b.tokenizer.hf.to_str())
