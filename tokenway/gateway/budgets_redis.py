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
The key's batch share (budgets.py) is three more of the same, {k}:batch:bud and so on, with
its own seed (what the key's batch lines cost) and epoch; a call with a share is decided,
held and settled in both by one script.

With a RedisLimiter on the same Redis, a budgeted call's budget and limits are one script
(joint_redis.py), built from this module's LUA_BUDGETS and limits_redis's LUA_LIMITS.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tokenway.gateway.budgets import (
    BudgetDecision,
    BudgetLease,
    BudgetReservation,
    BudgetState,
    JointStore,
    SeedReader,
    SpendSeed,
    check_amounts,
    check_lease_amounts,
    check_lease_settlement,
)
from tokenway.gateway.limits import LEASE_PART, LEASE_S, Limiter
from tokenway.gateway.limits_redis import LUA_PRELUDE, RedisLimiter, connect, redacted, run_script
from tokenway.ids import random_hex

# The rules of InProcessBudgets, as Lua functions over one key's three keys (KEY_NAMES'
# order), so that another script (joint_redis.py) can run them beside its own. Lua numbers
# are doubles: exact to 2**53 nanos (budgets.MAX_NANOS).
LUA_BUDGETS = """
local function budgets_store(keys)
  local bud, res, fly = unpack(keys)
  local B = {}

  -- A reservation's arguments (RedisBudgets.reservation_args), from ARGV[i] on.
  function B.reservation(i)
    return {budget = tonumber(ARGV[i]), worst = tonumber(ARGV[i + 1]), rid = ARGV[i + 2],
            ttl_us = tonumber(ARGV[i + 3]), state_ttl_ms = ARGV[i + 4], seed = ARGV[i + 5], new_epoch = ARGV[i + 6]}
  end

  function B.epoch() return redis.call('HGET', bud, 'epoch') end

  -- The key's epoch, seeding a key that has no state with r's seed; nil if r brings none.
  function B.open(r)
    local epoch = B.epoch()
    if epoch or r.seed == '' then return epoch end
    redis.call('HSET', bud, 'spent', r.seed, 'held', 0, 'epoch', r.new_epoch)
    return r.new_epoch
  end

  -- Reservations past their expiry give their holds back.
  function B.prune()
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

  function B.amounts()
    return tonumber(redis.call('HGET', bud, 'spent')), tonumber(redis.call('HGET', bud, 'held'))
  end

  -- A key that has used it all is refused even a free call (budgets.fits).
  function B.fits(r, spent, held) return spent + held + r.worst <= r.budget and spent < r.budget end

  function B.hold(r)
    redis.call('HSET', res, r.rid, int(r.worst))
    redis.call('ZADD', fly, int(now + r.ttl_us), r.rid)
    redis.call('HINCRBY', bud, 'held', int(r.worst))
  end

  function B.touch(state_ttl_ms) for _, key in ipairs(keys) do redis.call('PEXPIRE', key, state_ttl_ms) end end

  -- 1, or 0 for a state lost since the reservation, and seeded again from the ledger (or to be).
  function B.settle(rid, used, their_epoch, state_ttl_ms)
    if B.epoch() ~= their_epoch then return 0 end
    B.prune()
    local held = redis.call('HGET', res, rid)
    if held then  -- else it expired, and gave its hold back already; the cost is owed all the same
      redis.call('HINCRBY', bud, 'held', int(-tonumber(held)))
      redis.call('HDEL', res, rid)
      redis.call('ZREM', fly, rid)
    end
    redis.call('HINCRBY', bud, 'spent', int(used))
    B.touch(state_ttl_ms)
    return 1
  end

  -- InProcessBudgets.lease_now, with a lease's arguments (RedisBudgets.lease) from ARGV[i] on: up
  -- to want of the budget, at most budget / part and only what is free now, held as one
  -- reservation. {1, nanos, spent, held, epoch}; {0} where less than min would be granted; {-1}
  -- for a key not seeded, asked without a seed (the gateway reads the ledger and asks again).
  function B.lease(i)
    local budget, want, min = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local epoch = B.open({seed = ARGV[i + 7], new_epoch = ARGV[i + 8]})
    if not epoch then return {-1} end
    B.prune()
    local spent, held = B.amounts()
    local nanos = math.min(want, math.floor(budget / tonumber(ARGV[i + 6])), budget - spent - held)
    B.touch(ARGV[i + 5])
    if nanos < min or not B.fits({budget = budget, worst = nanos}, spent, held) then return {0} end
    B.hold({rid = ARGV[i + 3], worst = nanos, ttl_us = tonumber(ARGV[i + 4])})
    return {1, nanos, spent, held, epoch}
  end

  -- InProcessBudgets.settle_lease_now: cost is spent (owed whether or not the hold has
  -- expired), the lease's hold becomes held_nanos. 1, or 0 for a state seeded anew since.
  function B.settle_lease(rid, cost, held_nanos, their_epoch, state_ttl_ms)
    if B.epoch() ~= their_epoch then return 0 end
    B.prune()
    redis.call('HINCRBY', bud, 'spent', int(cost))
    local hold = redis.call('HGET', res, rid)
    if hold then
      redis.call('HINCRBY', bud, 'held', int(held_nanos - tonumber(hold)))
      if held_nanos > 0 then
        redis.call('HSET', res, rid, int(held_nanos))
      else
        redis.call('HDEL', res, rid)
        redis.call('ZREM', fly, rid)
      end
    end
    B.touch(state_ttl_ms)
    return 1
  end

  return B
end

-- A batch share's reservation: the call's own (r), under the share's budget, seed and epoch
-- from ARGV[i] on (RedisBudgets.share_args).
local function share_reservation(r, i)
  return {budget = tonumber(ARGV[i]), worst = r.worst, rid = r.rid, ttl_us = r.ttl_us,
          state_ttl_ms = r.state_ttl_ms, seed = ARGV[i + 1], new_epoch = ARGV[i + 2]}
end

-- The key's budget and, for a call with a share (its store and reservation), the share's:
-- opened, pruned and checked. nil where a state needs its seed first (the gateway reads the
-- ledger and asks again); else {fits, spent, held, epoch, share_epoch, by_share}, spent and
-- held the refusing state's (the key's where both fit).
local function check_budgets(budgets, r, share, sr)
  local epoch, share_epoch = budgets.open(r), ''
  if share then share_epoch = share.open(sr) end
  if not epoch or not share_epoch then return nil end
  budgets.prune()
  local spent, held = budgets.amounts()
  if not budgets.fits(r, spent, held) then return {0, spent, held, epoch, share_epoch, 0} end
  if share then
    share.prune()
    local share_spent, share_held = share.amounts()
    if not share.fits(sr, share_spent, share_held) then
      return {0, share_spent, share_held, epoch, share_epoch, 1}
    end
  end
  return {1, spent, held, epoch, share_epoch, 0}
end

-- Hold r in the key's budget and sr in its share (where the call has one); keep both alive.
local function hold_budgets(budgets, r, share, sr, fits)
  if fits then budgets.hold(r) end
  budgets.touch(r.state_ttl_ms)
  if share then
    if fits then share.hold(sr) end
    share.touch(r.state_ttl_ms)
  end
end
"""

# KEYS: the key's three, then its share's three for a call with a share ('state': the one asked).
# ARGV: op, then for reserve its reservation_args (and share_args); for settle settle_args; for
# lease and settle_lease what RedisBudgets.lease and settle_lease send.
LUA_SCRIPT = LUA_PRELUDE + LUA_BUDGETS + """
local op = ARGV[1]
local budgets = budgets_store({KEYS[1], KEYS[2], KEYS[3]})
local share = nil
if #KEYS > 3 then share = budgets_store({KEYS[4], KEYS[5], KEYS[6]}) end

if op == 'state' then
  if not budgets.epoch() then return {} end
  budgets.prune()
  local spent, held = budgets.amounts()
  return {spent, held}
end

if op == 'settle' then
  local done = budgets.settle(ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5])
  if share then share.settle(ARGV[2], tonumber(ARGV[3]), ARGV[6], ARGV[5]) end
  return done
end

if op == 'lease' then return budgets.lease(2) end
if op == 'settle_lease' then
  return budgets.settle_lease(ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6])
end

local r = budgets.reservation(2)
local sr = share and share_reservation(r, 9)
local decided = check_budgets(budgets, r, share, sr)
if not decided then return {-1} end  -- unseeded: the gateway reads the ledger and asks again
hold_budgets(budgets, r, share, sr, decided[1] == 1)
return decided
"""

KEY_NAMES = ("bud", "res", "fly")
# A reservation's seed and epoch, for a key the script answered unseeded; None the first time.
SeedArgs = tuple[int, str] | None
# The seeds a call asks with: the key's, and its share's (None for a call without one).
Seeds = tuple[SeedArgs, SeedArgs]


def seed_args(seed: SeedArgs) -> tuple[int | str, str]:
    """A seed and its epoch as a script reads them: two empty strings where there is none."""
    return seed if seed is not None else ("", "")


class RedisBudgets:
    """share_seed: what a key's batch lines have cost, to seed its share (None: the store takes no share)."""

    def __init__(self, url: str, seed: SpendSeed, *, share_seed: SpendSeed | None = None,
                 reservation_ttl_s: float = 600.0, state_ttl_s: float = 86400.0,
                 prefix: str = "tokenway:budgets", timeout_s: float = 1.0) -> None:
        if not 0 < reservation_ttl_s < state_ttl_s:
            raise ValueError("need 0 < reservation_ttl_s < state_ttl_s")
        self._seeds = SeedReader(seed)
        self._share_seeds = SeedReader(share_seed) if share_seed is not None else None
        self._ttl_us = round(reservation_ttl_s * 1e6)
        self._state_ttl_ms = round(state_ttl_s * 1000)
        self._prefix = prefix
        self.url = url
        self.where = redacted(url)
        self._redis = connect(url, timeout_s)
        self._script = self._redis.register_script(LUA_SCRIPT)

    def keys(self, key_id: str, share: bool = False) -> list[str]:
        """The key's three; with `share`, its batch share's three after them."""
        base = f"{self._prefix}:{{{key_id}}}"
        return [f"{base}:{name}" for name in KEY_NAMES] + ([f"{base}:batch:{name}" for name in KEY_NAMES]
                                                           if share else [])

    async def _run(self, key_id: str, args: list, keys: list[str] | None = None):
        return await run_script(self._script, keys if keys is not None else self.keys(key_id), args, self.where)

    def reservation_args(self, budget_nanos: int, worst_nanos: int, reservation_id: str, seed: SeedArgs
                         ) -> list[str | int]:
        return [budget_nanos, worst_nanos, reservation_id, self._ttl_us, self._state_ttl_ms, *seed_args(seed)]

    @staticmethod
    def share_args(share_nanos: int | None, seed: SeedArgs) -> list[str | int]:
        """A batch share's budget, seed and epoch, after reservation_args; none for a call without one."""
        if share_nanos is None:
            return []
        return [share_nanos, *seed_args(seed)]

    def settle_args(self, reservation: BudgetReservation, used_nanos: int) -> list[str | int]:
        if used_nanos < 0:
            raise ValueError(f"used_nanos must be >= 0, got {used_nanos}")
        return [reservation.reservation_id, used_nanos, reservation.epoch, self._state_ttl_ms,
                reservation.share_epoch or ""]

    async def seeded(self, key_id: str, ask: Callable[[Seeds], Awaitable[list]], share: bool = False) -> list:
        """ask((None, None))'s reply; for a key the script answers unseeded ([-1]), ask(seeds)'s,
        with the ledger's spend (and, with `share`, its batch lines' cost) and new epochs
        (SeedUnavailable when the ledger cannot say)."""
        reply = await ask((None, None))
        if reply[0] == -1:
            share_seed = None
            if share:
                if self._share_seeds is None:
                    raise ValueError("a batch share needs a store made with a share_seed")
                share_seed = (await self._share_seeds.read(key_id), random_hex())
            reply = await ask(((await self._seeds.read(key_id), random_hex()), share_seed))
        return reply

    @staticmethod
    def decision(key_id: str, reservation_id: str, worst_nanos: int, reply: list) -> BudgetDecision:
        """A reservation's BudgetDecision from check_budgets' reply."""
        allowed, spent, held, epoch, share_epoch, by_share = reply
        reservation = BudgetReservation(key_id, reservation_id, worst_nanos, epoch.decode(),
                                        share_epoch.decode() or None) if allowed else None
        return BudgetDecision(reservation, spent, held, bool(by_share))

    async def reserve(self, key_id: str, budget_nanos: int, worst_nanos: int,
                      share_nanos: int | None = None) -> BudgetDecision:
        check_amounts(budget_nanos, worst_nanos)
        if share_nanos is not None:
            check_amounts(share_nanos, worst_nanos)
        reservation_id, keys = random_hex(), self.keys(key_id, share_nanos is not None)
        reply = await self.seeded(key_id, lambda seeds: self._run(key_id, [
            "reserve", *self.reservation_args(budget_nanos, worst_nanos, reservation_id, seeds[0]),
            *self.share_args(share_nanos, seeds[1])], keys), share_nanos is not None)
        return self.decision(key_id, reservation_id, worst_nanos, reply)

    async def settle(self, reservation: BudgetReservation, used_nanos: int) -> None:
        await self._run(reservation.key_id, ["settle", *self.settle_args(reservation, used_nanos)],
                        self.keys(reservation.key_id, reservation.share_epoch is not None))

    async def lease(self, key_id: str, budget_nanos: int, want_nanos: int, min_nanos: int) -> BudgetLease | None:
        """InProcessBudgets.lease_now, in Redis: a part of the key's budget for this gateway's
        calls (leases.py), held there as one reservation. A key Redis has not seen is seeded
        from the ledger first, as for a reserve (SeedUnavailable when the ledger cannot say)."""
        check_lease_amounts(budget_nanos, want_nanos, min_nanos)
        reservation_id = random_hex()
        reply = await self.seeded(key_id, lambda seeds: self._run(key_id, [
            "lease", budget_nanos, want_nanos, min_nanos, reservation_id, self._ttl_us, self._state_ttl_ms,
            LEASE_PART, *seed_args(seeds[0])]))
        if reply[0] != 1:
            return None
        _, nanos, spent, held, epoch = reply
        return BudgetLease(key_id, reservation_id, nanos, LEASE_S, spent, held, epoch.decode())

    async def settle_lease(self, lease: BudgetLease, cost_nanos: int, held_nanos: int) -> None:
        """InProcessBudgets.settle_lease_now, in Redis."""
        check_lease_settlement(cost_nanos, held_nanos)
        await self._run(lease.key_id, ["settle_lease", lease.reservation_id, cost_nanos, held_nanos, lease.epoch,
                                       self._state_ttl_ms])

    async def state(self, key_id: str, share: bool = False) -> BudgetState | None:
        keys = self.keys(key_id, share)
        reply = await self._run(key_id, ["state"], keys[3:] if share else keys)
        return BudgetState(*reply) if reply else None

    def joint_with(self, limiter: Limiter) -> JointStore | None:
        """One script for both where the limiter is a RedisLimiter on this same Redis."""
        if not (isinstance(limiter, RedisLimiter) and limiter.url == self.url):
            return None
        from tokenway.gateway.joint_redis import RedisJoint  # it builds on this module

        return RedisJoint(limiter, self)

    async def close(self) -> None:
        await self._redis.aclose()
