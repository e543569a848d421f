"""The response cache's hook on a generation call (gateway/response_cache.py keys and keeps the
entries):

    route ─► admitted() (generation.py): guard, admit, then ResponseCache.lookup ─► CacheLookup
        None  the call is not covered: caching is off for its model and key, or its output is
              not a function of its job (neither greedy nor seeded, and not forced)
        hit   Generation replays the entry's events: no replica, no engine slot
        miss  Generation runs the job, keeping its replica's events; a call that ends whole
              (200, every choice finished) ─► ResponseCache.keep, in the background

A hit is admitted like any call (its RPM and limits count), billed at the model's
cached_response price (0 unless set) and traced with response_cache "hit". `Cache-Control:
no-cache` looks nothing up (the result is still kept); `no-store` does neither. Every covered
call's response says `x-tokenway-cache: hit` or `miss`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from starlette.requests import Request

from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Call
from tokenway.gateway.response_cache import CacheStore, cache_key, cacheable, decode_events, encode_events
from tokenway.protocol.job import GenerationJob, ReplicaEvent
from tokenway.routing.registry_config import ResponseCacheConfig

logger = logging.getLogger(__name__)
CACHE_HEADER = "x-tokenway-cache"
_DEFAULT_CONFIG = ResponseCacheConfig()  # a model whose config has no [models.cache]: off, unless a key turns it on


@dataclass(frozen=True, slots=True)
class CacheDirective:
    """What the caller's Cache-Control lets the cache do with its call."""

    lookup: bool = True
    store: bool = True

    @classmethod
    def of(cls, cache_control: str | None) -> CacheDirective:
        if not cache_control:
            return USE_CACHE
        directives = {part.split("=", 1)[0].strip().lower() for part in cache_control.split(",")}
        if "no-store" in directives:
            return cls(lookup=False, store=False)
        if "no-cache" in directives:
            return cls(lookup=False, store=True)
        return USE_CACHE


USE_CACHE = CacheDirective()


def cache_directive(request: Request) -> CacheDirective:
    return CacheDirective.of(request.headers.get("cache-control"))


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """A covered call's key, and what the cache had for it."""

    key: str
    ttl_s: float
    store: bool  # whether the call's result is kept once it ends whole
    events: tuple[ReplicaEvent, ...] | None = None  # a hit's events, to replay; None: a miss

    @property
    def status(self) -> str:
        return "miss" if self.events is None else "hit"

    @property
    def headers(self) -> dict[str, str]:
        return {CACHE_HEADER: self.status}


class ResponseCache:
    """The store and each model's [models.cache]; the puts in flight (close() waits for them)."""

    def __init__(self, store: CacheStore, model_to_config: Mapping[str, ResponseCacheConfig] | None = None) -> None:
        self.store = store
        self.model_to_config = dict(model_to_config or {})
        self._puts: set[asyncio.Task] = set()

    def config_for(self, model: str, principal: Principal) -> ResponseCacheConfig | None:
        """The model's cache settings where the cache covers this key's calls to it; None: off."""
        config = self.model_to_config.get(model, _DEFAULT_CONFIG)
        enabled = principal.response_cache if principal.response_cache is not None else config.enabled
        return config if enabled else None

    async def lookup(self, call: Call, job: GenerationJob, directive: CacheDirective) -> CacheLookup | None:
        """None for a call the cache does not cover; else its key, and the entry's events on a hit."""
        principal = call.start.principal
        config = self.config_for(job.model, principal)
        if config is None or not cacheable(job, config.forced):
            return None
        key = cache_key(call.start.endpoint, job, None if config.shared else principal.key_id)
        if not directive.lookup:
            return CacheLookup(key, config.ttl_s, directive.store)
        data = await self.store.get(key)
        if data is None:
            return CacheLookup(key, config.ttl_s, True)
        try:
            return CacheLookup(key, config.ttl_s, True, decode_events(data))
        except ValueError as exc:  # another writer's bytes under our prefix: a miss, overwritten when it ends
            logger.warning("response cache entry %s unreadable (%s): a miss", key, exc)
            return CacheLookup(key, config.ttl_s, True)

    def keep(self, lookup: CacheLookup, events: Sequence[ReplicaEvent]) -> None:
        """Store a miss's events in the background: the response does not wait for the store."""
        task = asyncio.get_running_loop().create_task(self.store.put(lookup.key, encode_events(events),
                                                                     lookup.ttl_s))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._puts, return_exceptions=True)
        await self.store.close()
