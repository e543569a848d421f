"""RedisLimiter: the limits of limits.py shared by every gateway process that uses one Redis.

Each admit, reconcile and headers call is one EVALSHA of LUA_SCRIPT, which Redis runs
atomically, so processes sharing a key can't over-admit between them. Time is Redis's own
TIME, read inside the script, so the gateways' clocks don't matter. Per key_id, under one
hash tag (a cluster keeps a key's state on one node):

    {k}:win   ZSET  reservation_id -> t_us         requests admitted in the window
    {k}:tok   HASH  reservation_id -> num_tokens   their tokens: reserved, then used
    {k}:day   HASH  bucket index   -> num_tokens   tokens per day bucket
    {k}:dayz  ZSET  bucket index   -> bucket index the live buckets, oldest first
    {k}:fly   ZSET  reservation_id -> expires_us   in flight (not reconciled, not expired)
    {k}:res   HASH  reservation_id -> "bucket:reserved"
    {k}:sum   HASH  tok -> sum of tok, day -> sum of day

Every admit sets all seven to expire together after the longest horizon that matters
(the window, the reservation TTL, the day when the key has a TPD), so an idle key leaves
nothing behind and the sums never outlive what they sum.

A Redis that is down, slow or refusing writes raises LimitsUnavailable within about
timeout_s (connect, command and pool waits are all bounded, and a dropped connection is
retried once, on a new one, so a restarted Redis answers at once).
"""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from tokenway.gateway.limits import (
    CONCURRENCY_RETRY_S,
    NUM_DAY_BUCKETS,
    Decision,
    LimitSpec,
    LimitsUnavailable,
    Refusal,
    Reservation,
    Windows,
    WindowState,
    make_decision,
    rate_headers,
    too_large,
)

# The same rules as InProcessLimiter, in the same integer microseconds. Numbers go back to
# Redis through int(): Lua would print a large one as "1.7e+15", which HINCRBY rejects.
LUA_SCRIPT = """
local win, tok, day, dayz, fly, res, sum = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local op, window, bucket_us = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local NUM_DAY_BUCKETS = tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local current = math.floor(now / bucket_us)

local function int(x) return string.format('%d', x) end

-- Remove the members of zset scored <= max_score, their fields of hash, and (when sum_field)
-- their values from that sum.
local function drop(zset, hash, sum_field, max_score)
  local ids = redis.call('ZRANGEBYSCORE', zset, '-inf', int(max_score))
  for i = 1, #ids, 1000 do
    local chunk = {unpack(ids, i, math.min(i + 999, #ids))}
    if sum_field then
      local n = 0
      for _, v in ipairs(redis.call('HMGET', hash, unpack(chunk))) do n = n + (tonumber(v) or 0) end
      redis.call('HINCRBY', sum, sum_field, int(-n))
    end
    redis.call('HDEL', hash, unpack(chunk))
    redis.call('ZREM', zset, unpack(chunk))
  end
end

local function prune()
  drop(win, tok, 'tok', now - window)
  drop(dayz, day, 'day', current - NUM_DAY_BUCKETS)
  drop(fly, res, nil, now)
end

local function get_sum(field) return tonumber(redis.call('HGET', sum, field) or '0') end

-- Walk zset oldest first, adding hash values, until num_to_free is reached: that member's score.
-- Pages grow 1, 10, 100, 1000: the answer is usually on the first.
local function score_freeing(zset, hash, num_to_free)
  local num_freed, start, size = 0, 0, 1
  while true do
    local page = redis.call('ZRANGE', zset, start, start + size - 1, 'WITHSCORES')
    if #page == 0 then return nil end
    local ids = {}
    for i = 1, #page, 2 do ids[#ids + 1] = page[i] end
    local values = redis.call('HMGET', hash, unpack(ids))
    for i = 1, #ids do
      num_freed = num_freed + (tonumber(values[i]) or 0)
      if num_freed >= num_to_free then return tonumber(page[2 * i]) end
    end
    start, size = start + size, math.min(size * 10, 1000)
  end
end

local function window_state()
  local num_requests = redis.call('ZCARD', win)
  local requests_reset, tokens_reset = 0, 0
  if num_requests > 0 then
    requests_reset = tonumber(redis.call('ZRANGE', win, -1, -1, 'WITHSCORES')[2]) + window - now
  end
  local num_tokens = get_sum('tok')
  local start, size = 0, 1
  while num_tokens > 0 and tokens_reset == 0 do  -- the newest request holding tokens
    local page = redis.call('ZREVRANGE', win, start, start + size - 1, 'WITHSCORES')
    if #page == 0 then break end
    local ids = {}
    for i = 1, #page, 2 do ids[#ids + 1] = page[i] end
    local values = redis.call('HMGET', tok, unpack(ids))
    for i = 1, #ids do
      if (tonumber(values[i]) or 0) > 0 then tokens_reset = tonumber(page[2 * i]) + window - now break end
    end
    start, size = start + size, math.min(size * 10, 1000)
  end
  return {num_requests, requests_reset, num_tokens, tokens_reset}
end

prune()

if op == 'peek' then return window_state() end

if op == 'reconcile' then
  local rid, used = ARGV[5], tonumber(ARGV[6])
  local held = redis.call('HGET', res, rid)
  if not held then return 0 end  -- reconciled already, or expired
  local sep = string.find(held, ':')
  local bucket, reserved = string.sub(held, 1, sep - 1), tonumber(string.sub(held, sep + 1))
  local delta = used - reserved
  if redis.call('HEXISTS', tok, rid) == 1 then  -- still in the window
    redis.call('HINCRBY', tok, rid, int(delta))
    redis.call('HINCRBY', sum, 'tok', int(delta))
  end
  if redis.call('ZSCORE', dayz, bucket) then  -- its bucket is still live
    redis.call('HINCRBY', day, bucket, int(delta))
    redis.call('HINCRBY', sum, 'day', int(delta))
  end
  redis.call('HDEL', res, rid)
  redis.call('ZREM', fly, rid)
  return 1
end

-- admit: limits are -1 when unlimited
local ttl, rpm, tpm, tpd, max_concurrent = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]),
  tonumber(ARGV[8]), tonumber(ARGV[9])
local reserve, rid, horizon_ms, concurrency_wait = tonumber(ARGV[10]), ARGV[11], ARGV[12], tonumber(ARGV[13])
local kind, wait = 0, 0  -- the failing limit that takes longest to pass (1 requests, 2 tokens, 3 day, 4 slots)
local function fail(k, w) if w > wait then kind, wait = k, w end end

local num_requests = redis.call('ZCARD', win)
if rpm >= 0 and num_requests >= rpm then
  fail(1, tonumber(redis.call('ZRANGE', win, num_requests - rpm, num_requests - rpm, 'WITHSCORES')[2]) + window - now)
end
local num_tokens = get_sum('tok')
if tpm >= 0 and num_tokens + reserve > tpm then
  fail(2, score_freeing(win, tok, num_tokens + reserve - tpm) + window - now)
end
local num_day_tokens = get_sum('day')
if tpd >= 0 and num_day_tokens + reserve > tpd then
  fail(3, (score_freeing(dayz, day, num_day_tokens + reserve - tpd) + NUM_DAY_BUCKETS) * bucket_us - now)
end
if max_concurrent >= 0 and redis.call('ZCARD', fly) >= max_concurrent then fail(4, concurrency_wait) end

if kind == 0 then
  redis.call('ZADD', win, int(now), rid)
  redis.call('HSET', tok, rid, int(reserve))
  redis.call('HINCRBY', sum, 'tok', int(reserve))
  redis.call('HINCRBY', day, int(current), int(reserve))
  redis.call('ZADD', dayz, int(current), int(current))
  redis.call('HINCRBY', sum, 'day', int(reserve))
  redis.call('ZADD', fly, int(now + ttl), rid)
  redis.call('HSET', res, rid, int(current) .. ':' .. int(reserve))
  for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, horizon_ms) end
end
local state = window_state()
return {kind, wait, now, state[1], state[2], state[3], state[4]}
"""

KIND_NAMES = {1: "requests", 2: "tokens", 3: "tokens_per_day", 4: "concurrency"}


def _limit_arg(value: int | None) -> int:
    return -1 if value is None else value


def connect(url: str, timeout_s: float) -> aioredis.Redis:
    """A client whose every wait is bounded by about timeout_s: a dead Redis must not hang calls."""
    # A pool that waits for a free connection: the default one raises MaxConnectionsError
    # once admissions plus background reconciles pass 100 at a time. One retry, on a fresh
    # connection, for a pooled connection that a restarted Redis dropped; no backoff: a Redis
    # that is really down answers the policy's way now, not after redis-py's ten retries.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=256, timeout=timeout_s, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1))
    return aioredis.Redis(connection_pool=pool)


def redacted(url: str) -> str:
    """The URL for log lines: no user or password."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


async def run_script(script: AsyncScript, keys: list[str], args: list, where: str):
    """One EVALSHA; LimitsUnavailable (naming the store, never its password) if Redis cannot answer."""
    try:
        return await script(keys=keys, args=args)
    except (RedisError, OSError, TimeoutError) as exc:
        raise LimitsUnavailable(f"{where}: {type(exc).__name__}: {exc}") from None


class RedisLimiter:
    def __init__(
        self,
        url: str,
        *,
        window_s: float = 60.0,
        day_s: float = 86400.0,
        reservation_ttl_s: float = 600.0,
        prefix: str = "tokenway:limits",
        timeout_s: float = 1.0,
    ):
        self.windows = Windows.from_seconds(window_s, day_s, reservation_ttl_s)
        self._day_us = self.windows.bucket_us * NUM_DAY_BUCKETS
        self._prefix = prefix
        self.where = redacted(url)
        self._redis = connect(url, timeout_s)
        self._script = self._redis.register_script(LUA_SCRIPT)  # EVALSHA, loading it once if missing

    async def _run(self, key_id: str, args: list) -> list:
        return await run_script(self._script, self._keys(key_id), args, self.where)

    def _keys(self, key_id: str) -> list[str]:
        base = f"{self._prefix}:{{{key_id}}}"
        return [f"{base}:{name}" for name in ("win", "tok", "day", "dayz", "fly", "res", "sum")]

    def _args(self, op: str) -> list[str | int]:
        return [op, self.windows.window_us, self.windows.bucket_us, NUM_DAY_BUCKETS]

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int) -> Decision:
        refusal = too_large(spec, reserve_tokens)
        reservation_id = uuid.uuid4().hex
        horizon_us = max(
            self.windows.window_us, self.windows.reservation_ttl_us, self._day_us if spec.tpd is not None else 0
        )
        args = self._args("admit") + [
            self.windows.reservation_ttl_us,
            _limit_arg(spec.rpm),
            _limit_arg(spec.tpm),
            _limit_arg(spec.tpd),
            _limit_arg(spec.max_concurrent),
            reserve_tokens,
            reservation_id,
            horizon_us // 1000 + 1000,  # ms, and a second to spare
            round(CONCURRENCY_RETRY_S * 1e6),
        ]
        if refusal is not None:  # nothing to record: only the headers' state is needed
            state = WindowState(*await self._run(key_id, self._args("peek")))
            return make_decision(spec, state, None, refusal)
        kind, wait_us, now_us, *state = await self._run(key_id, args)
        if kind != 0:
            return make_decision(spec, WindowState(*state), None, Refusal(KIND_NAMES[kind], wait_us))
        reservation = Reservation(key_id, reservation_id, reserve_tokens, now_us / 1e6)
        return make_decision(spec, WindowState(*state), reservation, None)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        args = self._args("reconcile") + [reservation.reservation_id, used_tokens]
        await self._run(reservation.key_id, args)

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        state = await self._run(key_id, self._args("peek"))
        return rate_headers(spec, WindowState(*state))

    async def close(self) -> None:
        await self._redis.aclose()
