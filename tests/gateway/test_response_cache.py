"""The response cache's keys, entries and stores (gateway/response_cache.py): in memory with a
fake clock, and a real Redis (scripts/redis.sh)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest

from tokenway.gateway.response_cache import (
    MemoryStore,
    cache_key,
    cacheable,
    decode_events,
    encode_events,
    open_store,
)
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ToolCallDelta, Usage
from tokenway.protocol.outputs import TokenLogprob
from tokenway.protocol.sampling import SamplingParams

ENDPOINT = "/v1/chat/completions"


def make_job(request_id: str = "chatcmpl-1", **fields) -> GenerationJob:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 16, **fields.pop("params", {})})
    return GenerationJob(request_id, fields.pop("model", "m"), "chat", params,
                         messages=fields.pop("messages", ({"role": "user", "content": "hi"},)), **fields)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- keys --------------------------------------------------------------------------------


def test_equal_jobs_made_apart_have_one_key():
    assert cache_key(ENDPOINT, make_job(), "k1") == cache_key(ENDPOINT, make_job(), "k1")


def test_what_changes_no_output_leaves_the_key():
    base = cache_key(ENDPOINT, make_job(), "k1")
    assert cache_key(ENDPOINT, make_job("chatcmpl-2", stream=True, deadline=5.0, service_class="flex"),
                     "k1") == base


@pytest.mark.parametrize("change", [
    {"messages": ({"role": "user", "content": "hi!"},)},
    {"messages": ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})},
    {"params": {"max_tokens": 17}},
    {"params": {"stop": ("x",)}},
    {"params": {"seed": 1}},
    {"params": {"logprobs": 2}},
    {"n": 2},
    {"model": "other"},
    {"tools": ({"type": "function", "function": {"name": "f", "parameters": {}}},)},
    {"tool_choice": "none"},
    {"response_format": {"type": "json_object"}},
    {"prompt_token_ids": (1, 2, 3)},
])
def test_what_changes_the_output_changes_the_key(change):
    assert cache_key(ENDPOINT, make_job(**change), "k1") != cache_key(ENDPOINT, make_job(), "k1")


def test_the_api_and_the_key_are_in_the_key():
    job = make_job()
    keys = {cache_key(ENDPOINT, job, "k1"), cache_key("/v1/messages", job, "k1"), cache_key(ENDPOINT, job, "k2"),
            cache_key(ENDPOINT, job, None)}
    assert len(keys) == 4


def test_only_greedy_or_seeded_calls_are_cached_unless_forced():
    assert cacheable(make_job(), forced=False)
    assert cacheable(make_job(params={"temperature": 0.7, "seed": 3}), forced=False)
    assert not cacheable(make_job(params={"temperature": 0.7}), forced=False)
    assert cacheable(make_job(params={"temperature": 0.7}), forced=True)


# ---- entries -----------------------------------------------------------------------------


def test_events_come_back_as_they_were_kept_without_their_engine_times():
    events = [
        ChoiceDelta(0, "Hel", (1, 2), num_cached_tokens=16, cache_reason="hit", engine_times=(1.0, 2.0, 3.0),
                    logprobs=(TokenLogprob(1, -0.5, 1, [(1, -0.5), (7, -1.25)]),
                              TokenLogprob(2, -0.25, 2, [(9, -0.1)]))),
        ChoiceDelta(1, "", reasoning="thinking", tool_calls=(ToolCallDelta(0, "call_1", "f", '{"a"'),
                                                             ToolCallDelta(0, arguments=": 1}")),
                    logprobs=({"token": "x", "logprob": -1.0, "top_logprobs": []},)),
        ChoiceDelta(0, "lo \ud800 é", (3,), finish_reason="stop", stop_reason=7),
        ChoiceDelta(1, "", finish_reason="tool_calls", stop_reason="</call>"),
        Usage(12, 5, cached_tokens=8, reasoning_tokens=2, counted_by="tokenizer", cache_reason="hit"),
    ]
    decoded = decode_events(encode_events(events))
    assert list(decoded) == [dataclasses.replace(events[0], engine_times=None), *events[1:]]


@pytest.mark.parametrize("data", [b"not json", b'[{"x": 1}]', b'[{"d": [0]}]', b"{}"])
def test_bytes_it_did_not_write_are_refused(data):
    with pytest.raises(ValueError, match="not a response cache entry"):
        decode_events(data)


# ---- the memory store -------------------------------------------------------------------


def test_an_entry_lives_its_ttl():
    async def main():
        clock = FakeClock()
        store = MemoryStore(1000, clock)
        await store.put("a", b"one", ttl_s=10)
        clock.now += 9.9
        assert await store.get("a") == b"one"
        clock.now += 0.1
        assert await store.get("a") is None
        assert len(store) == 0 and store.num_bytes == 0

    asyncio.run(main())


def test_the_least_recently_used_go_first_within_the_bound():
    async def main():
        store = MemoryStore(3 * 11, FakeClock())  # three entries of 1 + 10 bytes
        for key in "abc":
            await store.put(key, b"x" * 10, ttl_s=60)
        assert await store.get("a") == b"x" * 10  # a is now the most recent: b goes first
        await store.put("d", b"y" * 10, ttl_s=60)
        assert [await store.get(key) is not None for key in "abcd"] == [True, False, True, True]
        assert store.num_bytes == 33
        await store.put("e", b"z" * 21, ttl_s=60)  # room for it: the two least recent go
        assert [await store.get(key) is not None for key in "acde"] == [False, False, True, True]
        assert store.num_bytes == 11 + 22

    asyncio.run(main())


def test_an_entry_larger_than_the_bound_is_not_kept_and_a_new_value_replaces_the_old():
    async def main():
        store = MemoryStore(20, FakeClock())
        await store.put("a", b"1234", ttl_s=60)
        await store.put("b", b"x" * 20, ttl_s=60)
        assert await store.get("b") is None and await store.get("a") == b"1234"
        await store.put("a", b"12", ttl_s=60)
        assert await store.get("a") == b"12" and store.num_bytes == 3

    asyncio.run(main())


def test_a_store_url_is_memory_or_redis():
    assert open_store("memory", 10).url == "memory"
    with pytest.raises(ValueError, match="response_cache_url"):
        open_store("memcached://x", 10)
    with pytest.raises(ValueError, match="response_cache_bytes"):
        MemoryStore(0)


# ---- Redis ---------------------------------------------------------------------------------


def test_redis_keeps_an_entry_for_its_ttl(redis_url):
    import redis.asyncio as aioredis

    async def main():
        store = open_store(redis_url, 1)
        key = uuid.uuid4().hex
        try:
            assert await store.get(key) is None
            await store.put(key, b"entry", ttl_s=30)
            assert await store.get(key) == b"entry"
            client = aioredis.Redis.from_url(redis_url)
            ttl_ms = await client.pttl(f"tokenway:rc:{key}")
            await client.aclose()
            assert 0 < ttl_ms <= 30_000
            await store.put(key + "x", b"brief", ttl_s=0.05)
            await asyncio.sleep(0.2)
            assert await store.get(key + "x") is None
        finally:
            await store.close()

    asyncio.run(main())


def test_a_redis_that_is_down_is_a_miss_not_an_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed

    async def main():
        store = open_store(f"redis://127.0.0.1:{port}/0", 1)
        try:
            await store.put("k", b"v", ttl_s=10)
            assert await store.get("k") is None
        finally:
            await store.close()

    asyncio.run(main())
