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
A call with a batch share (a batch line) brings the share's three budget keys and, where the
key has limits, its seven limits keys: checked, held and settled with the key's own.
"""

from __future__ import annotations

from tokenway.gateway.budgets import BudgetDecision, BudgetReservation, JointDecision, check_amounts
from tokenway.gateway.budgets_redis import LUA_BUDGETS, RedisBudgets
from tokenway.gateway.limits import LimitSpec, Reservation, too_large
from tokenway.gateway.limits_redis import KEY_NAMES, LUA_LIMITS, LUA_PRELUDE, RedisLimiter, run_script
from tokenway.ids import random_hex

# KEYS: the budget's three, the limits' eight; for a call with a batch share, then the share's
# three budget keys and, where the key has limits, its eight limits keys (11, 14 or 22 keys).
# ARGV: op, the limits' window_args (3), then
#   admit   the budget's reservation_args (7), the limits' admission_args (9), '1' where the
#           caller knows the limits refuse (a request larger than a limit): the budget is decided,
#           nothing is held; with a share, its budget's share_args (3), its limits' share_args (5)
#   settle  the budget's settle_args (5), the limits' reservation id and tokens used
LUA_SCRIPT = LUA_PRELUDE + LUA_LIMITS + LUA_BUDGETS + """
local op = ARGV[1]
local w, b, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local budgets = budgets_store({KEYS[1], KEYS[2], KEYS[3]})
local limits = limits_store({unpack(KEYS, 4, 11)}, w, b, n)
local budget_share, limits_share = nil, nil
if #KEYS >= 14 then budget_share = budgets_store({KEYS[12], KEYS[13], KEYS[14]}) end
if #KEYS >= 22 then limits_share = limits_store({unpack(KEYS, 15, 22)}, w, b, n) end

if op == 'settle' then
  budgets.settle(ARGV[5], tonumber(ARGV[6]), ARGV[7], ARGV[8])
  if budget_share then budget_share.settle(ARGV[5], tonumber(ARGV[6]), ARGV[9], ARGV[8]) end
  limits.prune()
  limits.reconcile(ARGV[10], tonumber(ARGV[11]))
  if limits_share then
    limits_share.prune()
    limits_share.reconcile(ARGV[10], tonumber(ARGV[11]))
  end
  return 1
end

local r, admission, limits_refuse = budgets.reservation(5), limits.admission(12), ARGV[21] == '1'
local sr = budget_share and share_reservation(r, 22)
local sa = limits_share and share_admission(admission, 25)
local decided = check_budgets(budgets, r, budget_share, sr)
if not decided then return {-1} end  -- unseeded: the gateway reads the ledger and asks again
if decided[1] == 0 then
  hold_budgets(budgets, r, budget_share, sr, false)
  return decided
end
limits.prune()
if limits_share then limits_share.prune() end
local kind, wait = 0, 0
if not limits_refuse then kind, wait = check_with_share(limits, admission, limits_share, sa) end
local admitted = kind == 0 and not limits_refuse
hold_budgets(budgets, r, budget_share, sr, admitted)
if admitted then
  limits.record(admission)
  if limits_share then limits_share.record(sa) end
end
local state = limits.window_state()
return {1, decided[2], decided[3], decided[4], decided[5], 0, kind, wait, now, state[1], state[2], state[3], state[4]}
"""


class RedisJoint:
    """A JointStore: runs on the limiter's connections; the stores close them."""

    def __init__(self, limiter: RedisLimiter, budgets: RedisBudgets) -> None:
        self._limiter = limiter
        self._budgets = budgets
        self.where = limiter.where
        self._script = limiter.redis.register_script(LUA_SCRIPT)

    def _keys(self, key_id: str, budget_share: bool, limits_share: bool) -> list[str]:
        budget_keys, limits_keys = self._budgets.keys(key_id, budget_share), self._limiter.keys(key_id, limits_share)
        num_limits_keys = len(KEY_NAMES)
        return budget_keys[:3] + limits_keys[:num_limits_keys] + budget_keys[3:] + limits_keys[num_limits_keys:]

    async def admit(self, key_id: str, spec: LimitSpec, reserve_tokens: int, budget_nanos: int,
                    worst_nanos: int, share: LimitSpec | None = None,
                    share_nanos: int | None = None) -> JointDecision:
        check_amounts(budget_nanos, worst_nanos)
        if share_nanos is not None:
            check_amounts(share_nanos, worst_nanos)
        # The keys' layout takes a limits share only beside a budget share; the gatekeeper gives
        # a batch line both or neither.
        assert share is None or share_nanos is not None, "a limits share comes with a budget share"
        refusal = too_large(spec, reserve_tokens, share)
        reservation_id = random_hex()  # the call's in both stores, each its own namespace
        keys = self._keys(key_id, share_nanos is not None, share is not None)
        head = ["admit", *self._limiter.window_args()]
        limits_args = [*self._limiter.admission_args(spec, reserve_tokens, reservation_id), int(refusal is not None)]
        reply = await self._budgets.seeded(key_id, lambda seeds: run_script(self._script, keys, [
            *head, *self._budgets.reservation_args(budget_nanos, worst_nanos, reservation_id, seeds[0]),
            *limits_args, *self._budgets.share_args(share_nanos, seeds[1]), *self._limiter.share_args(share)],
            self.where), share_nanos is not None)
        budget = self._budgets.decision(key_id, reservation_id, worst_nanos, reply[:6])
        if not reply[0]:
            return JointDecision(budget, None)
        decision = self._limiter.decision(key_id, spec, reserve_tokens, reservation_id, reply[6:], refusal,
                                          in_share=share is not None)
        if not decision.allowed:  # the budget held nothing either
            budget = BudgetDecision(None, budget.spent_nanos, budget.held_nanos)
        return JointDecision(budget, decision)

    async def settle(self, budget: BudgetReservation, used_nanos: int, reservation: Reservation,
                     used_tokens: int) -> None:
        assert budget.key_id == reservation.key_id, (budget.key_id, reservation.key_id)
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        keys = self._keys(budget.key_id, budget.share_epoch is not None, reservation.in_share)
        await run_script(self._script, keys, ["settle", *self._limiter.window_args(),
                                              *self._budgets.settle_args(budget, used_nanos),
                                              reservation.reservation_id, used_tokens], self.where)
