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
    {k}:sum   HASH  tok -> sum of tok, day -> sum of day, req -> sum of req
    {k}:req   HASH  lease_id -> num_requests - 1     a lease's requests beyond its one member of win

A lease (leases.py, as limits.py's InProcessLimiter grants them to --workers N) is one member
of win, scored at the last moment a gateway may admit from it (granted + lease_s, Redis's
clock), holding its tokens in tok and its requests beyond one in req: a key's requests are
ZCARD(win) + sum.req, and the wait for a request to free walks win adding each member's weight.

Every admit sets all eight to expire together after the longest horizon that matters
(the window, the reservation TTL, the day when the key has a TPD), so an idle key leaves
nothing behind and the sums never outlive what they sum. The key's batch share (limits.py)
is eight more of the same, {k}:batch:win and so on, under the same hash tag: a call with a
share is checked against both and recorded in both (or neither) by one script.

The script is Lua functions over one key's state (LUA_LIMITS) and a few lines that call them,
so that joint_redis.py runs the same functions beside the budget's in one script.

A Redis that is down, slow or refusing writes raises LimitsUnavailable within about
timeout_s (connect, command and pool waits are all bounded, and a dropped connection is
retried once, on a new one, so a restarted Redis answers at once).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from tokenway.gateway.limits import (
    CONCURRENCY_RETRY_S,
    LEASE_PART,
    LEASE_S,
    NUM_DAY_BUCKETS,
    Decision,
    Lease,
    LimitSpec,
    LimitsUnavailable,
    Refusal,
    Reservation,
    Windows,
    WindowState,
    check_lease_ask,
    check_lease_settlement,
    make_decision,
    rate_headers,
    too_large,
)
from tokenway.ids import random_hex

# What every script here opens with: Redis's TIME, read once (so the stores of a joint script
# agree on the time), and int(). Numbers go back to Redis through int(): Lua would print a
# large one as "1.7e+15", which HINCRBY rejects.
LUA_PRELUDE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local function int(x) return string.format('%d', x) end
"""

# The same rules as InProcessLimiter, in the same integer microseconds, as Lua functions over
# one key's eight keys (KEY_NAMES' order), so that another script (joint_redis.py) can run
# them beside its own. Limits are -1 when unlimited.
LUA_LIMITS = """
local function limits_store(keys, window, bucket_us, NUM_DAY_BUCKETS)
  local win, tok, day, dayz, fly, res, sum, req = unpack(keys)
  local current = math.floor(now / bucket_us)
  local L = {}

  -- Remove from sum_field of sum the values of hash's fields ids (when sum_field), and the fields.
  local function drop_fields(hash, sum_field, ids)
    if sum_field then
      local n = 0
      for _, v in ipairs(redis.call('HMGET', hash, unpack(ids))) do n = n + (tonumber(v) or 0) end
      if n ~= 0 then redis.call('HINCRBY', sum, sum_field, int(-n)) end
    end
    redis.call('HDEL', hash, unpack(ids))
  end

  -- Remove the members of zset scored <= max_score, their fields of hash, and (when sum_field)
  -- their values from that sum; with leases, their fields of req and its sum too.
  local function drop(zset, hash, sum_field, max_score, leases)
    local ids = redis.call('ZRANGEBYSCORE', zset, '-inf', int(max_score))
    local has_leases = leases and #ids > 0 and redis.call('EXISTS', req) == 1
    for i = 1, #ids, 1000 do
      local chunk = {unpack(ids, i, math.min(i + 999, #ids))}
      drop_fields(hash, sum_field, chunk)
      if has_leases then drop_fields(req, 'req', chunk) end
      redis.call('ZREM', zset, unpack(chunk))
    end
  end

  function L.prune()
    drop(win, tok, 'tok', now - window, true)
    drop(dayz, day, 'day', current - NUM_DAY_BUCKETS)
    drop(fly, res, nil, now)
  end

  local function get_sum(field) return tonumber(redis.call('HGET', sum, field) or '0') end

  -- The window's requests: a member each, and a lease's beyond its one.
  function L.num_requests() return redis.call('ZCARD', win) + get_sum('req') end

  -- Walk zset oldest first, adding each member's weight (base + its hash value), until
  -- num_to_free is reached: that member's score. Pages grow 1, 10, 100, 1000: the answer is
  -- usually on the first.
  local function score_freeing(zset, hash, num_to_free, base)
    local num_freed, start, size = 0, 0, 1
    while true do
      local page = redis.call('ZRANGE', zset, start, start + size - 1, 'WITHSCORES')
      if #page == 0 then return nil end
      local ids = {}
      for i = 1, #page, 2 do ids[#ids + 1] = page[i] end
      local values = redis.call('HMGET', hash, unpack(ids))
      for i = 1, #ids do
        num_freed = num_freed + base + (tonumber(values[i]) or 0)
        if num_freed >= num_to_free then return tonumber(page[2 * i]) end
      end
      start, size = start + size, math.min(size * 10, 1000)
    end
  end

  function L.window_state()
    local num_requests = L.num_requests()
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

  -- An admission's arguments (RedisLimiter.admission_args), from ARGV[i] on.
  function L.admission(i)
    return {ttl = tonumber(ARGV[i]), rpm = tonumber(ARGV[i + 1]), tpm = tonumber(ARGV[i + 2]),
            tpd = tonumber(ARGV[i + 3]), max_concurrent = tonumber(ARGV[i + 4]), reserve = tonumber(ARGV[i + 5]),
            rid = ARGV[i + 6], horizon_ms = ARGV[i + 7], concurrency_wait = tonumber(ARGV[i + 8])}
  end

  -- The failing limit that takes longest to pass (1 requests, 2 tokens, 3 day, 4 slots) and
  -- that wait; 0, 0 when all pass.
  function L.check(a)
    local kind, wait = 0, 0
    local function fail(k, w) if w > wait then kind, wait = k, w end end
    local num_requests = L.num_requests()
    if a.rpm >= 0 and num_requests >= a.rpm then  -- admissible once the (num_requests - rpm + 1) oldest have left
      fail(1, score_freeing(win, req, num_requests - a.rpm + 1, 1) + window - now)
    end
    local num_tokens = get_sum('tok')
    if a.tpm >= 0 and num_tokens + a.reserve > a.tpm then
      fail(2, score_freeing(win, tok, num_tokens + a.reserve - a.tpm, 0) + window - now)
    end
    local num_day_tokens = get_sum('day')
    if a.tpd >= 0 and num_day_tokens + a.reserve > a.tpd then
      fail(3, (score_freeing(dayz, day, num_day_tokens + a.reserve - a.tpd, 0) + NUM_DAY_BUCKETS) * bucket_us - now)
    end
    if a.max_concurrent >= 0 and redis.call('ZCARD', fly) >= a.max_concurrent then fail(4, a.concurrency_wait) end
    return kind, wait
  end

  function L.record(a)
    redis.call('ZADD', win, int(now), a.rid)
    redis.call('HSET', tok, a.rid, int(a.reserve))
    redis.call('HINCRBY', sum, 'tok', int(a.reserve))
    redis.call('HINCRBY', day, int(current), int(a.reserve))
    redis.call('ZADD', dayz, int(current), int(current))
    redis.call('HINCRBY', sum, 'day', int(a.reserve))
    redis.call('ZADD', fly, int(now + a.ttl), a.rid)
    redis.call('HSET', res, a.rid, int(current) .. ':' .. int(a.reserve))
    for _, key in ipairs(keys) do redis.call('PEXPIRE', key, a.horizon_ms) end
  end

  -- 1, or 0 for a reservation reconciled already, or expired.
  function L.reconcile(rid, used)
    local held = redis.call('HGET', res, rid)
    if not held then return 0 end
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

  -- A lease's arguments (what RedisLimiter.lease sends), from ARGV[i] on.
  function L.lease_ask(i)
    return {rpm = tonumber(ARGV[i]), tpm = tonumber(ARGV[i + 1]), tpd = tonumber(ARGV[i + 2]),
            want_requests = tonumber(ARGV[i + 3]), want_tokens = tonumber(ARGV[i + 4]),
            min_tokens = tonumber(ARGV[i + 5]), lease_us = tonumber(ARGV[i + 6]), lid = ARGV[i + 7],
            horizon_ms = ARGV[i + 8], part = tonumber(ARGV[i + 9])}
  end

  -- limits.py InProcessLimiter.lease_now: up to the requests and tokens asked, at most 1/part of
  -- each limit and only what is free now, counted as admitted at now + lease_us. {1, requests,
  -- tokens, the window's requests and tokens before it}, or {0} where less than one request and
  -- min_tokens tokens would be granted.
  function L.lease(a)
    local num_requests, num_tokens, num_day_tokens = L.num_requests(), get_sum('tok'), get_sum('day')
    local n, t = a.want_requests, a.want_tokens
    if a.rpm >= 0 then n = math.min(n, math.floor(a.rpm / a.part), a.rpm - num_requests) end
    if a.tpm >= 0 then t = math.min(t, math.floor(a.tpm / a.part), a.tpm - num_tokens) end
    if a.tpd >= 0 then t = math.min(t, math.floor(a.tpd / a.part), a.tpd - num_day_tokens) end
    if n < 1 or t < a.min_tokens then return {0} end
    local t_us = now + a.lease_us
    local bucket = int(math.floor(t_us / bucket_us))
    redis.call('ZADD', win, int(t_us), a.lid)
    redis.call('HSET', tok, a.lid, int(t))
    redis.call('HINCRBY', sum, 'tok', int(t))
    redis.call('HSET', req, a.lid, int(n - 1))
    redis.call('HINCRBY', sum, 'req', int(n - 1))
    redis.call('HINCRBY', day, bucket, int(t))
    redis.call('ZADD', dayz, bucket, bucket)
    redis.call('HINCRBY', sum, 'day', int(t))
    for _, key in ipairs(keys) do redis.call('PEXPIRE', key, a.horizon_ms) end
    return {1, n, t, num_requests, num_tokens}
  end

  -- limits.py InProcessLimiter.settle_lease_now: the lease's figures become what its calls
  -- used. 1, or 0 for a lease out of the window already.
  function L.settle_lease(lid, n, t)
    local t_us = redis.call('ZSCORE', win, lid)
    if not t_us then return 0 end
    local delta = t - tonumber(redis.call('HGET', tok, lid) or '0')
    redis.call('HSET', tok, lid, int(t))
    redis.call('HINCRBY', sum, 'tok', int(delta))
    local bucket = int(math.floor(tonumber(t_us) / bucket_us))
    if redis.call('ZSCORE', dayz, bucket) then  -- its bucket is still live
      redis.call('HINCRBY', day, bucket, int(delta))
      redis.call('HINCRBY', sum, 'day', int(delta))
    end
    local extra = n - 1 - tonumber(redis.call('HGET', req, lid) or '0')
    redis.call('HSET', req, lid, int(n - 1))
    redis.call('HINCRBY', sum, 'req', int(extra))
    return 1
  end

  return L
end

-- A batch share's admission: the call's own (a), under the share's limits from ARGV[i] on
-- (RedisLimiter.share_args).
local function share_admission(a, i)
  return {ttl = a.ttl, rpm = tonumber(ARGV[i]), tpm = tonumber(ARGV[i + 1]), tpd = tonumber(ARGV[i + 2]),
          max_concurrent = tonumber(ARGV[i + 3]), reserve = a.reserve, rid = a.rid, horizon_ms = ARGV[i + 4],
          concurrency_wait = a.concurrency_wait}
end

-- The key's limits and, where the call has a share (its store and admission), the share's: the
-- failing limit that takes longest to pass (the share's kinds are 5 to 8) and that wait; 0, 0
-- when all pass.
local function check_with_share(limits, a, share, sa)
  local kind, wait = limits.check(a)
  if share then
    local share_kind, share_wait = share.check(sa)
    if share_wait > wait then kind, wait = share_kind + 4, share_wait end
  end
  return kind, wait
end
"""

# KEYS: the key's eight, then its batch share's eight for a call with a share.
# ARGV: op, the window lengths (window_args), then for admit its admission_args (and, with a
# share, its share_args); for reconcile the reservation's id and the tokens used; for lease its
# lease_args; for settle_lease the lease's id, requests and tokens.
LUA_SCRIPT = LUA_PRELUDE + LUA_LIMITS + """
local op = ARGV[1]
local w, b, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local limits = limits_store({unpack(KEYS, 1, 8)}, w, b, n)
local share = nil
if #KEYS > 8 then share = limits_store({unpack(KEYS, 9, 16)}, w, b, n) end
limits.prune()
if share then share.prune() end
if op == 'peek' then return limits.window_state() end
if op == 'reconcile' then
  local done = limits.reconcile(ARGV[5], tonumber(ARGV[6]))
  if share then share.reconcile(ARGV[5], tonumber(ARGV[6])) end
  return done
end
if op == 'lease' then return limits.lease(limits.lease_ask(5)) end
if op == 'settle_lease' then return limits.settle_lease(ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])) end
local admission = limits.admission(5)
local share_adm = share and share_admission(admission, 14)
local kind, wait = check_with_share(limits, admission, share, share_adm)
if kind == 0 then
  limits.record(admission)
  if share then share.record(share_adm) end
end
local state = limits.window_state()
return {kind, wait, now, state[1], state[2], state[3], state[4]}
"""

KEY_NAMES = ("win", "tok", "day", "dayz", "fly", "res", "sum", "req")
KIND_NAMES = {1: "requests", 2: "tokens", 3: "tokens_per_day", 4: "concurrency"}  # 5 to 8: the share's


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
        lease_s: float = LEASE_S,
    ):
        self.windows = Windows.from_seconds(window_s, day_s, reservation_ttl_s)
        if not lease_s > 0:
            raise ValueError("lease_s must be positive")
        self.lease_s = lease_s
        self._day_us = self.windows.bucket_us * NUM_DAY_BUCKETS
        self._prefix = prefix
        self.url = url  # which Redis: a budget store on the same one joins this limiter's scripts
        self.where = redacted(url)
        self.redis = connect(url, timeout_s)
        self._script = self.redis.register_script(LUA_SCRIPT)  # EVALSHA, loading it once if missing

    async def _run(self, key_id: str, args: list, share: bool = False) -> list:
        return await run_script(self._script, self.keys(key_id, share), args, self.where)

    def keys(self, key_id: str, share: bool = False) -> list[str]:
        """The key's eight; with `share`, its batch share's eight after them."""
        base = f"{self._prefix}:{{{key_id}}}"
        return [f"{base}:{name}" for name in KEY_NAMES] + ([f"{base}:batch:{name}" for name in KEY_NAMES]
                                                           if share else [])

    def window_args(self) -> list[int]:
        return [self.windows.window_us, self.windows.bucket_us, NUM_DAY_BUCKETS]

    def _horizon_ms(self, spec: LimitSpec) -> int:
        horizon_us = max(
            self.windows.window_us, self.windows.reservation_ttl_us, self._day_us if spec.tpd is not None else 0
        )
        return horizon_us // 1000 + 1000  # ms, and a second to spare

    def share_args(self, share: LimitSpec | None) -> list[int]:
        """A batch share's limits, after admission_args; none for a call without one."""
        if share is None:
            return []
        return [_limit_arg(share.rpm), _limit_arg(share.tpm), _limit_arg(share.tpd), _limit_arg(share.max_concurrent),
                self._horizon_ms(share)]

    def admission_args(self, spec: LimitSpec, reserve_tokens: int, reservation_id: str) -> list[str | int]:
        return [
            self.windows.reservation_ttl_us,
            _limit_arg(spec.rpm),
            _limit_arg(spec.tpm),
            _limit_arg(spec.tpd),
            _limit_arg(spec.max_concurrent),
            reserve_tokens,
            reservation_id,
            self._horizon_ms(spec),
            round(CONCURRENCY_RETRY_S * 1e6),
        ]

    @staticmethod
    def decision(key_id: str, spec: LimitSpec, reserve_tokens: int, reservation_id: str, reply: list,
                 refusal: Refusal | None = None, in_share: bool = False) -> Decision:
        """An admission's Decision from the script's reply (kind, wait_us, now_us, window state);
        `refusal`: the caller's own, for a request larger than a limit."""
        kind, wait_us, now_us, *state = reply
        if refusal is None and kind != 0:
            refusal = Refusal(KIND_NAMES[(kind - 1) % 4 + 1], wait_us, kind > 4)
        reservation = (Reservation(key_id, reservation_id, reserve_tokens, now_us / 1e6, in_share)
                       if refusal is None else None)
        return make_decision(spec, WindowState(*state), reservation, refusal)

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                    share: LimitSpec | None = None) -> Decision:
        refusal = too_large(spec, reserve_tokens, share)
        if refusal is not None:  # nothing to record: only the headers' state is needed
            state = WindowState(*await self._run(key_id, ["peek", *self.window_args()]))
            return make_decision(spec, state, None, refusal)
        reservation_id = random_hex()
        args = ["admit", *self.window_args(), *self.admission_args(spec, reserve_tokens, reservation_id),
                *self.share_args(share)]
        reply = await self._run(key_id, args, share is not None)
        return self.decision(key_id, spec, reserve_tokens, reservation_id, reply, in_share=share is not None)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        args = ["reconcile", *self.window_args(), reservation.reservation_id, used_tokens]
        await self._run(reservation.key_id, args, reservation.in_share)

    async def lease(self, key_id: str, spec: LimitSpec, want_requests: int, want_tokens: int,
                    min_tokens: int) -> Lease | None:
        """InProcessLimiter.lease_now, in Redis: a slice of the key's limits for this gateway's
        calls (leases.py), counted as admitted lease_s from now on Redis's clock."""
        check_lease_ask(want_requests, want_tokens, min_tokens)
        if spec.max_concurrent is not None:
            return None  # a leased call would hold no slot here
        lease_us = round(self.lease_s * 1e6)
        lease_id = random_hex()
        reply = await self._run(key_id, [
            "lease", *self.window_args(), _limit_arg(spec.rpm), _limit_arg(spec.tpm), _limit_arg(spec.tpd),
            want_requests, want_tokens, min_tokens, lease_us, lease_id,
            self._horizon_ms(spec) + lease_us // 1000, LEASE_PART])
        if not reply[0]:
            return None
        _, num_requests, num_tokens, num_window_requests, num_window_tokens = reply
        return Lease(key_id, lease_id, num_requests, num_tokens, self.lease_s, self.windows.window_us,
                     num_window_requests, num_window_tokens)

    async def settle_lease(self, lease: Lease, num_requests: int, num_tokens: int) -> None:
        """InProcessLimiter.settle_lease_now, in Redis."""
        check_lease_settlement(num_requests, num_tokens)
        await self._run(lease.key_id, ["settle_lease", *self.window_args(), lease.lease_id, num_requests, num_tokens])

    async def headers(self, key_id: str, spec: LimitSpec) -> dict[str, str]:
        state = await self._run(key_id, ["peek", *self.window_args()])
        return rate_headers(spec, WindowState(*state))

    async def close(self) -> None:
        await self.redis.aclose()
