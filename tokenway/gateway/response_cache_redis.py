"""RedisStore: the response cache's entries in a Redis every gateway on it shares, each one
`tokenway:rc:<key>` set with its TTL (SET PX); Redis's maxmemory and eviction policy bound
the whole. A Redis that is down or slow is a miss within about timeout_s, and a put that fails
is dropped: the cache never fails a call. Imported only for --response-cache-url redis://."""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from tokenway.gateway.limits_redis import connect, redacted

logger = logging.getLogger(__name__)
KEY_PREFIX = "tokenway:rc:"
_WARN_EVERY_S = 30.0  # a Redis that is down says so in the log, not on every call


class RedisStore:
    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        self.url = redacted(url)
        self._redis = connect(url, timeout_s)
        self._last_warning = -_WARN_EVERY_S

    async def get(self, key: str) -> bytes | None:
        try:
            value = await self._redis.get(KEY_PREFIX + key)
            return value if isinstance(value, bytes) else None
        except (RedisError, OSError, TimeoutError) as exc:
            self._warn("get", exc)
            return None

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        try:
            await self._redis.set(KEY_PREFIX + key, value, px=max(1, round(ttl_s * 1000)))
        except (RedisError, OSError, TimeoutError) as exc:
            self._warn("put", exc)

    def _warn(self, operation: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning("response cache %s on %s failed (%s: %s): calls run uncached", operation, self.url,
                           type(exc).__name__, exc)

    async def close(self) -> None:
        await self._redis.aclose()
