"""RedisJoint: a budgeted call's budget and limits in one script, where a RedisBudgets and a
RedisLimiter share one Redis (as `tokenway serve --limits-url` builds them).

    admit   one EVALSHA: the budget is checked, then (if it fits) the limits; only if both pass
            are both reservations recorded, so a refused call holds nothing in either store
    settle  one EVALSHA: the budget's settle and the limits' reconcile of one call

Asked in turn, the budget and the limiter were two round trips on every budgeted call's
path, and a limits refusal left a budget hold to give back in a third. The script is the
two stores' own Lua functions (budgets_redis.LUA_BUDGETS, limits_redis.LUA_LIMITS) run side
by side, not a copy of their rules. Its ten keys (the budget's three, then the limits' seven)
share the key's hash tag {key_id}, so a cluster keeps them on one slot, as one script needs.
A key the budget store has not seeded costs a second EVALSHA, as RedisBudgets.reserve does.
"""

from __future__ import annotations

import uuid

from tokenway.gateway.budgets import BudgetDecision, BudgetReservation, JointDecision, check_amounts
from tokenway.gateway.budgets_redis import LUA_BUDGETS, RedisBudgets
from tokenway.gateway.limits import LimitSpec, Reservation, too_large
from tokenway.gateway.limits_redis import LUA_LIMITS, LUA_PRELUDE, RedisLimiter, run_script

# KEYS: the budget's three, then the limits' seven.
# ARGV: op, the limits' window_args (3), then
#   admit   the budget's reservation_args (7), the limits' admission_args (9), and '1' where the
#           caller knows the limits refuse (a request larger than a limit): the budget is decided,
#           nothing is held
#   settle  the budget's settle_args (4), the limits' reservation id and tokens used
LUA_SCRIPT = LUA_PRELUDE + LUA_LIMITS + LUA_BUDGETS + """
local op = ARGV[1]
local budgets = budgets_store({KEYS[1], KEYS[2], KEYS[3]})
local limits = limits_store({unpack(KEYS, 4, 10)}, tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]))

if op == 'settle' then
  budgets.settle(ARGV[5], tonumber(ARGV[6]), ARGV[7], ARGV[8])
  limits.prune()
  limits.reconcile(ARGV[9], tonumber(ARGV[10]))
  return 1
end

local r, admission, limits_refuse = budgets.reservation(5), limits.admission(12), ARGV[21] == '1'
local epoch = budgets.open(r)
if not epoch then return {-1} end  -- unseeded: the gateway reads the ledger and asks again
budgets.prune()
local spent, held = budgets.amounts()
if not budgets.fits(r, spent, held) then
  budgets.touch(r.state_ttl_ms)
  return {0, spent, held, epoch}
end
limits.prune()
local kind, wait = 0, 0
if not limits_refuse then kind, wait = limits.check(admission) end
if kind == 0 and not limits_refuse then
  budgets.hold(r)
  limits.record(admission)
end
budgets.touch(r.state_ttl_ms)
local state = limits.window_state()
return {1, spent, held, epoch, kind, wait, now, state[1], state[2], state[3], state[4]}
"""


class RedisJoint:
    """A JointStore: runs on the limiter's connections; the stores close them."""

    def __init__(self, limiter: RedisLimiter, budgets: RedisBudgets) -> None:
        self._limiter = limiter
        self._budgets = budgets
        self.where = limiter.where
        self._script = limiter.redis.register_script(LUA_SCRIPT)

    async def _run(self, key_id: str, args: list) -> list:
        return await run_script(self._script, self._budgets.keys(key_id) + self._limiter.keys(key_id), args,
                                self.where)

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int, budget_nanos: int,
                    worst_nanos: int) -> JointDecision:
        check_amounts(budget_nanos, worst_nanos)
        refusal = too_large(spec, reserve_tokens)
        reservation_id = uuid.uuid4().hex  # the call's in both stores, each its own namespace
        head = ["admit", *self._limiter.window_args()]
        tail = [*self._limiter.admission_args(spec, reserve_tokens, reservation_id), int(refusal is not None)]
        reply = await self._budgets.seeded(key_id, lambda seed: self._run(key_id, [
            *head, *self._budgets.reservation_args(budget_nanos, worst_nanos, reservation_id, seed), *tail]))
        fits, spent, held, epoch, *limits_reply = reply
        if not fits:
            return JointDecision(BudgetDecision(None, spent, held), None)
        decision = self._limiter.decision(key_id, spec, reserve_tokens, reservation_id, limits_reply, refusal)
        budget = BudgetReservation(key_id, reservation_id, worst_nanos, epoch.decode()) if decision.allowed else None
        return JointDecision(BudgetDecision(budget, spent, held), decision)

    async def settle(self, budget: BudgetReservation, used_nanos: int, reservation: Reservation,
                     used_tokens: int) -> None:
        assert budget.key_id == reservation.key_id, (budget.key_id, reservation.key_id)
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        await self._run(budget.key_id, ["settle", *self._limiter.window_args(),
                                        *self._budgets.settle_args(budget, used_nanos),
                                        reservation.reservation_id, used_tokens])
