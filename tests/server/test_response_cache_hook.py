"""The response cache's hook (server/response_cache.py): what Cache-Control lets it do, which
calls it covers for which key, and a kept miss found again, on the in-memory store."""

from __future__ import annotations

import asyncio

import pytest

from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Call, CallStart
from tokenway.gateway.response_cache import MemoryStore
from tokenway.protocol.job import ChoiceDelta, GenerationJob, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.registry_config import ResponseCacheConfig
from tokenway.server.response_cache import USE_CACHE, CacheDirective, ResponseCache

EVENTS = (ChoiceDelta(0, "Blue.", (5, 6), finish_reason="stop"), Usage(9, 2))


def make_call(key_id: str = "k1", response_cache: bool | None = None) -> Call:
    return Call(CallStart("/v1/chat/completions", Principal(key_id=key_id, name=key_id,
                                                             response_cache=response_cache)))


def make_job(model: str = "cached", temperature: float = 0.0) -> GenerationJob:
    return GenerationJob("chatcmpl-1", model, "chat", SamplingParams(temperature=temperature),
                         messages=({"role": "user", "content": "Name a colour."},))


def make_cache(**config) -> ResponseCache:
    return ResponseCache(MemoryStore(1 << 20), {"cached": ResponseCacheConfig(enabled=True, **config),
                                                "plain": ResponseCacheConfig()})


@pytest.mark.parametrize(("header", "directive"), [
    (None, USE_CACHE), ("", USE_CACHE), ("max-age=0", USE_CACHE),
    ("no-cache", CacheDirective(lookup=False, store=True)), ("No-Cache, max-age=0", CacheDirective(False, True)),
    ("no-store", CacheDirective(False, False)), ("no-cache, no-store", CacheDirective(False, False)),
])
def test_cache_control(header, directive):
    assert CacheDirective.of(header) == directive


def test_the_model_turns_it_on_and_a_key_overrides_it_either_way():
    cache = make_cache()
    on = cache.model_to_config["cached"]
    assert cache.config_for("cached", make_call().start.principal) is on
    assert cache.config_for("cached", make_call(response_cache=False).start.principal) is None
    assert cache.config_for("plain", make_call().start.principal) is None
    assert cache.config_for("unconfigured", make_call(response_cache=True).start.principal) is not None


def test_a_kept_miss_is_found_again_by_its_key_only():
    async def main():
        cache = make_cache()
        assert await cache.lookup(make_call(), make_job(temperature=0.5), USE_CACHE) is None
        miss = await cache.lookup(make_call(), make_job(), USE_CACHE)
        assert miss is not None and miss.status == "miss" and miss.headers == {"x-tokenway-cache": "miss"}
        cache.keep(miss, EVENTS)
        await asyncio.sleep(0)  # the put, in the background
        hit = await cache.lookup(make_call(), make_job(), USE_CACHE)
        assert hit is not None and hit.status == "hit" and hit.events == EVENTS and hit.key == miss.key
        other_key = await cache.lookup(make_call("k2"), make_job(), USE_CACHE)
        assert other_key is not None and other_key.status == "miss"
        bypassed = await cache.lookup(make_call(), make_job(), CacheDirective.of("no-cache"))
        assert bypassed is not None and bypassed.status == "miss" and bypassed.store
        unstored = await cache.lookup(make_call(), make_job(), CacheDirective.of("no-store"))
        assert unstored is not None and unstored.status == "miss" and not unstored.store

    asyncio.run(main())


def test_a_shared_entry_serves_every_key():
    async def main():
        cache = make_cache(shared=True)
        miss = await cache.lookup(make_call("k1"), make_job(), USE_CACHE)
        assert miss is not None
        cache.keep(miss, EVENTS)
        await asyncio.sleep(0)
        hit = await cache.lookup(make_call("k2"), make_job(), USE_CACHE)
        assert hit is not None and hit.events == EVENTS

    asyncio.run(main())
