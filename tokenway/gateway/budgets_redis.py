"""RedisBudgets: the budgets of budgets.py shared by every gateway process that uses one Redis.

Each reserve, settle and state call is one EVALSHA of LUA_SCRIPT, which Redis runs
atomically, so gateways sharing a key cannot over-admit between them. Per key_id, under one
hash tag (a cluster keeps a key's state on one node), in integer nano-dollars:

    {k}:bud   HASH  spent, held, epoch             the settled spend, the sum of holds, the seed's id
    {k}:res   HASH  reservation_id -> nanos        the holds in flight
    {k}:fly   ZSET  reservation_id -> expires_us   ... and when each lapses (Redis's TIME)

A key Redis has no state for (never seen, idle past state_ttl_s, or lost in a restart) is
seeded: the script answers "unseeded", the gateway reads the ledger (Ledger.spend_usd) and
asks again with the seed and a new epoch; of gateways seeding at once, the first one's
stands. A settle carries its reservation's epoch: for a state re-seeded since, it is dropped,
since the seed read the ledger, where the call's row was. (A call in flight across such a
loss whose row reaches the ledger only after the re-seed is missed until the key re-seeds.)
Every call sets the three keys to expire together state_ttl_s after the key's last call.
"""

from __future__ import annotations

import uuid

from tokenway.gateway.budgets import (
    BudgetDecision,
    BudgetReservation,
    BudgetState,
    SeedReader,
    SpendSeed,
    check_amounts,
)
from tokenway.gateway.limits_redis import connect, redacted, run_script

# Numbers go back to Redis through int(): Lua would print a large one as "1.7e+15", which
# HINCRBY rejects. Lua numbers are doubles: exact to 2**53 nanos (budgets.MAX_NANOS).
LUA_SCRIPT = """
local bud, res, fly = KEYS[1], KEYS[2], KEYS[3]
local op = ARGV[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local function int(x) return string.format('%d', x) end

-- Reservations past their expiry give their holds back.
local function prune()
  local ids = redis.call('ZRANGEBYSCORE', fly, '-inf', int(now))
  for i = 1, #ids, 1000 do
    local chunk = {unpack(ids, i, math.min(i + 999, #ids))}
    local n = 0
    for _, v in ipairs(redis.call('HMGET', res, unpack(chunk))) do n = n + (tonumber(v) or 0) end
    redis.call('HINCRBY', bud, 'held', int(-n))
    redis.call('HDEL', res, unpack(chunk))
    redis.call('ZREM', fly, unpack(chunk))
  end
end

local function amounts()
  return tonumber(redis.call('HGET', bud, 'spent')), tonumber(redis.call('HGET', bud, 'held'))
end

local function touch(state_ttl_ms) for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, state_ttl_ms) end end

local epoch = redis.call('HGET', bud, 'epoch')

if op == 'state' then
  if not epoch then return {} end
  prune()
  local spent, held = amounts()
  return {spent, held}
end

if op == 'settle' then
  local rid, used, their_epoch, state_ttl_ms = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
  if epoch ~= their_epoch then return 0 end  -- lost since, and seeded again from the ledger (or to be)
  prune()
  local held = redis.call('HGET', res, rid)
  if held then  -- else it expired, and gave its hold back already; the cost is owed all the same
    redis.call('HINCRBY', bud, 'held', int(-tonumber(held)))
    redis.call('HDEL', res, rid)
    redis.call('ZREM', fly, rid)
  end
  redis.call('HINCRBY', bud, 'spent', int(used))
  touch(state_ttl_ms)
  return 1
end

-- reserve
local budget, worst, rid, ttl_us, state_ttl_ms = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]),
  ARGV[6]
if not epoch then
  if ARGV[7] == '' then return {-1} end  -- unseeded: the gateway reads the ledger and asks again
  epoch = ARGV[8]
  redis.call('HSET', bud, 'spent', ARGV[7], 'held', 0, 'epoch', epoch)
end
prune()
local spent, held = amounts()
local allowed = 0
if spent + held + worst <= budget and spent < budget then
  redis.call('HSET', res, rid, int(worst))
  redis.call('ZADD', fly, int(now + ttl_us), rid)
  redis.call('HINCRBY', bud, 'held', int(worst))
  allowed = 1
end
touch(state_ttl_ms)
return {allowed, spent, held, epoch}
"""


class RedisBudgets:
    def __init__(self, url: str, seed: SpendSeed, *, reservation_ttl_s: float = 600.0, state_ttl_s: float = 86400.0,
                 prefix: str = "tokenway:budgets", timeout_s: float = 1.0) -> None:
        if not 0 < reservation_ttl_s < state_ttl_s:
            raise ValueError("need 0 < reservation_ttl_s < state_ttl_s")
        self._seeds = SeedReader(seed)
        self._ttl_us = round(reservation_ttl_s * 1e6)
        self._state_ttl_ms = round(state_ttl_s * 1000)
        self._prefix = prefix
        self.where = redacted(url)
        self._redis = connect(url, timeout_s)
        self._script = self._redis.register_script(LUA_SCRIPT)

    def _keys(self, key_id: str) -> list[str]:
        base = f"{self._prefix}:{{{key_id}}}"
        return [f"{base}:{name}" for name in ("bud", "res", "fly")]

    async def _run(self, key_id: str, args: list):
        return await run_script(self._script, self._keys(key_id), args, self.where)

    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int) -> BudgetDecision:
        check_amounts(budget_nanos, worst_nanos)
        args = ["reserve", budget_nanos, worst_nanos, uuid.uuid4().hex, self._ttl_us, self._state_ttl_ms, "", ""]
        reply = await self._run(key_id, args)
        if reply[0] == -1:
            args[6:] = [await self._seeds.read(key_id), uuid.uuid4().hex]
            reply = await self._run(key_id, args)
        allowed, spent, held, epoch = reply
        reservation = BudgetReservation(key_id, args[3], worst_nanos, epoch.decode()) if allowed else None
        return BudgetDecision(reservation, spent, held)

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        if used_nanos < 0:
            raise ValueError(f"used_nanos must be >= 0, got {used_nanos}")
        await self._run(reservation.key_id, ["settle", reservation.reservation_id, used_nanos, reservation.epoch,
                                             self._state_ttl_ms])

    async def state(self, key_id: str) -> BudgetState | None:
        reply = await self._run(key_id, ["state"])
        return BudgetState(*reply) if reply else None

    async def close(self) -> None:
        await self._redis.aclose()
