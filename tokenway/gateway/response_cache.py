"""The exact-match response cache: a finished call's replica events, kept under a hash of what
decides them, and replayed when the same call comes again (server/response_cache.py hooks it in).

    endpoint, GenerationJob, key id (unless shared) ─► cache_key ─► CacheStore.get ─► events (a hit)
    a call that finished (200, every choice ended) ─► encode_events ─► CacheStore.put(key, ttl)

What is kept is the replica's events (ChoiceDelta ... Usage) as the replica sent them, not an
API's body: a hit runs through the same reasoning split, tool-call parsing, safety screen and
renderer the miss ran through, so its body is the miss's (ids and times aside), a stream replays
the same events, and a stream may hit what a JSON call kept (and the other way round).

Only a call whose output is a function of its job is cached: greedy (temperature 0) or seeded,
unless the model's config forces it. Stores: MemoryStore (LRU under a byte bound, a TTL per
entry) and RedisStore (response_cache_redis.py). A store that fails is a miss, never a failed call.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, ToolCallDelta, Usage
from tokenway.protocol.outputs import TokenLogprob

# Part of every key: a change to what a key covers, or to the encoding, starts a new key space.
KEY_VERSION = "tokenway-response-cache-1"


def cacheable(job: GenerationJob, forced: bool) -> bool:
    """Whether the job's output is decided by the job itself: greedy, or seeded (a seeded draw
    repeats on the same replica), or the model's config caches every call regardless."""
    return forced or job.params.temperature == 0 or job.params.seed is not None


def cache_key(endpoint: str, job: GenerationJob, key_id: str | None) -> str:
    """The hash over everything that changes a job's output, and the API it came through.
    key_id: the caller's key, so an entry serves only the key that made it; None: shared by
    every key. The request id, stream, deadline and service tier change no output: a stream
    hits what a JSON call kept. Two equal jobs hash the same; a difference anywhere (a dict's
    key order included) is a miss, never a wrong hit."""
    material = repr((KEY_VERSION, endpoint, key_id, job.model, job.kind, job.params, job.n, job.messages,
                     job.tools, job.tool_choice, job.parallel_tool_calls, job.response_format, job.prompt,
                     job.prompt_token_ids, job.context_window, job.thinking))
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()


# ---- the entry: a call's events as bytes -------------------------------------------------


def encode_events(events: Sequence[ReplicaEvent]) -> bytes:
    """JSON, not pickle: an entry read back from a shared Redis must not be able to run code."""
    return json.dumps([_encode(event) for event in events], separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8", "surrogatepass")


def decode_events(data: bytes) -> tuple[ReplicaEvent, ...]:
    """The events encode_events kept; ValueError for bytes it did not write."""
    try:
        items = json.loads(data.decode("utf-8", "surrogatepass"))
        if not isinstance(items, list):
            raise TypeError(f"a list of events, got {type(items).__name__}")
        return tuple(_decode(item) for item in items)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a response cache entry: {exc}") from None


def _encode(event: ReplicaEvent) -> dict[str, Any]:
    if isinstance(event, Usage):
        return {"u": [event.prompt_tokens, event.completion_tokens, event.cached_tokens, event.reasoning_tokens,
                      event.counted_by, event.cache_reason]}
    # engine_times are when the miss ran, on this host's clock: a replay has none of its own.
    return {"d": [event.index, event.text, list(event.token_ids), event.reasoning,
                  [[t.index, t.id, t.name, t.arguments] for t in event.tool_calls], event.finish_reason,
                  event.stop_reason, None if event.logprobs is None else [_encode_logprob(lp) for lp in event.logprobs],
                  event.num_cached_tokens, event.cache_reason]}


def _decode(item: dict[str, Any]) -> ReplicaEvent:
    if "u" in item:
        prompt, completion, cached, reasoning, counted_by, cache_reason = item["u"]
        return Usage(prompt, completion, cached, reasoning, counted_by, cache_reason)
    index, text, token_ids, reasoning, tool_calls, finish_reason, stop_reason, logprobs, num_cached, cache_reason = \
        item["d"]
    return ChoiceDelta(index, text, tuple(token_ids), reasoning, tuple(ToolCallDelta(*t) for t in tool_calls),
                       finish_reason, stop_reason,
                       None if logprobs is None else tuple(_decode_logprob(lp) for lp in logprobs),
                       num_cached, cache_reason)


def _encode_logprob(logprob: Any) -> Any:
    """An engine's TokenLogprob as a list; an upstream's (an OpenAI-shaped dict) as it is."""
    if isinstance(logprob, TokenLogprob):
        return [logprob.token_id, logprob.logprob, logprob.rank, logprob.top]
    return logprob


def _decode_logprob(item: Any) -> Any:
    if isinstance(item, list):
        token_id, logprob, rank, top = item
        return TokenLogprob(token_id, logprob, rank, [(t, lp) for t, lp in top])
    return item


# ---- stores -----------------------------------------------------------------------------


class CacheStore(Protocol):
    url: str  # what log lines name it by (no password)

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """This process's entries, least recently used first, within max_bytes (values and keys).
    An expired entry is dropped when read, or when the bound needs its room. Event loop only."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1:
            raise ValueError(f"response_cache_bytes: must be >= 1, got {max_bytes}")
        self.url = "memory"
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._clock = clock
        self._key_to_entry: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires_at, value)

    def __len__(self) -> int:
        return len(self._key_to_entry)

    async def get(self, key: str) -> bytes | None:
        entry = self._key_to_entry.get(key)
        if entry is None:
            return None
        expires_at, value = entry
        if self._clock() >= expires_at:
            self._drop(key)
            return None
        self._key_to_entry.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Keep value for ttl_s; one larger than the whole bound is not kept (it would evict all)."""
        size = len(key) + len(value)
        if key in self._key_to_entry:
            self._drop(key)
        if size > self.max_bytes:
            return
        self._key_to_entry[key] = (self._clock() + ttl_s, value)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._key_to_entry)))

    def _drop(self, key: str) -> None:
        _, value = self._key_to_entry.pop(key)
        self.num_bytes -= len(key) + len(value)

    async def close(self) -> None:
        self._key_to_entry.clear()
        self.num_bytes = 0


def open_store(url: str, max_bytes: int) -> CacheStore:
    """--response-cache-url: "memory" (this process, max_bytes) or redis://... (shared by every
    gateway on it; Redis's own maxmemory bounds it)."""
    if url == "memory":
        return MemoryStore(max_bytes)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from tokenway.gateway.response_cache_redis import RedisStore

        return RedisStore(url)
    raise ValueError(f"response_cache_url: expected 'memory' or redis://host:port, got {url!r}")
