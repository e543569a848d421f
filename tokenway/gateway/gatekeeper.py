"""Stages 1 and 7 around every API call: who is calling, may they, how much, what it cost.

    socket ─► GatewayMiddleware ─► authenticate (key → Principal) ─► route: parse, tokenize
          ─► admit: model allowed? the budget reserves the call's worst-case cost (budgets.py),
             then the limits reserve prompt + max_tokens of every choice (limits.py), both in
             one step where the two stores share a Redis (joint_redis.py); a batch line in the
             key's batch share of both as well (shares.py) ─► engine
          ─► finish: price the usage; both reservations settle to what was used and billed
          ─► the ledger row is committed before the response's last byte leaves

The call's facts come as frozen values (gateway/call.py): admit() makes the Admission, and the
one ledger row is derived from the call's CallOutcome, whatever happened (completed, refused,
failed, or the client gone). A refused call (401, 403, 429, a 4xx before generation) bills
nothing, and whatever it had reserved settles to 0. A limits store that cannot answer is
handled by the limits_on_error policy (outage.py), on every call into it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenway.billing.ledger import Ledger, UsageRecord
from tokenway.billing.pricing import ModelPrice, PriceTable, cost_usd, response_cache_cost_usd
from tokenway.gateway.auth import (
    ANONYMOUS,
    AuthPolicy,
    Principal,
    authorize_model,
    check_service_tiers,
    principal_for,
)
from tokenway.gateway.budgets import (
    BudgetDecision,
    BudgetReservation,
    BudgetStore,
    InProcessBudgets,
    JointStore,
    SeedUnavailable,
    format_usd,
    nanos_down,
    nanos_up,
)
from tokenway.gateway.call import Call, CallOutcome
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import (
    CONCURRENCY_RETRY_S,
    Decision,
    Limiter,
    LimitSpec,
    LimitsUnavailable,
    Reservation,
)
from tokenway.gateway.outage import StoreGuard
from tokenway.gateway.shares import BatchShare, batch_spend_seed
from tokenway.gateway.tiers import DEFAULT_GRANT, TierAsk, call_tier, granted_tiers, resolve
from tokenway.observability.traces import Trace
from tokenway.protocol.errors import (
    AuthenticationError,
    FieldError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
)
from tokenway.protocol.job import ServiceClass

logger = logging.getLogger(__name__)
BOTH_STORES = ("budgets", "limits")  # the StoreGuard names a joint store's operations go by


@dataclass(frozen=True, slots=True)
class Admission:
    """Gatekeeper.admit's answer for an admitted call: the limiter's decision (its reservation
    and the x-ratelimit-* headers to send) and the budget's reservation, both settled when the
    call ends: to the tokens used, and to the cost billed."""

    decision: Decision | None  # None: admitted without the limits store (down, limits_on_error open)
    reserved_tokens: int
    budget: BudgetReservation | None = None  # None: the key has no budget, or its store was down (open)

    @property
    def rate_headers(self) -> dict[str, str]:
        return self.decision.headers if self.decision is not None else {}


@dataclass(frozen=True, slots=True)
class _BudgetAsk:
    """What a budgeted call asks of its key's budget, and what its refusal is told from."""

    price: ModelPrice
    budget_nanos: int
    worst_nanos: int  # the prompt and every choice's max_tokens at the model's price, uncached
    num_prompt_tokens: int
    n: int
    share_nanos: int | None = None  # the key's batch share of the budget, for a batch line


@dataclass(slots=True)
class Defaults:
    """Limits for keys that set none (and for the anonymous caller when auth is off)."""

    rpm: int | None = None
    tpm: int | None = None
    tpd: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None
    max_messages: int = 2048
    service_tiers: tuple[ServiceClass, ...] = DEFAULT_GRANT  # what a key that names no tiers may run at
    batch_share: BatchShare = BatchShare()  # of every key's limits and budget, what its batch lines may use

    def __post_init__(self) -> None:
        try:
            check_service_tiers(self.service_tiers)
        except FieldError as exc:  # named as the config names it
            raise FieldError("default_service_tiers", exc.reason) from None


class Gatekeeper:
    """budgets: the budget store (default: in process, seeded from `ledger`); limits_on_error:
    "open" or "closed", what a call gets while the limiter's or the budgets' store is down;
    auth_mode "auto", "on" or "off" and has_admin_key: when a call needs a key (AuthPolicy)."""

    def __init__(self, keys: KeyStore, limiter: Limiter, ledger: Ledger, prices: PriceTable, defaults: Defaults,
                 host: str, *, budgets: BudgetStore | None = None, limits_on_error: str = "open",
                 auth_mode: str = "auto", has_admin_key: bool = False) -> None:
        self.auth = AuthPolicy(auth_mode, host, has_admin_key)
        self.keys = keys
        self.limiter = limiter
        self.ledger = ledger
        self.prices = prices
        self.defaults = defaults
        self.host = host
        self.budgets = budgets if budgets is not None else InProcessBudgets(
            ledger.spend_usd, share_seed=batch_spend_seed(ledger))
        # The two stores as one where they share a Redis: a budgeted call's admission is then one
        # round trip, not two, and a refused call holds nothing even for a moment.
        self.joint = self.budgets.joint_with(limiter)
        self.guard = StoreGuard(limits_on_error)
        # Stores that settle calls in line, not as a task of their own, say which they did: the
        # in-process ones every call (they never wait and are never down), the workers' leases
        # (leases.py) those admitted from a lease.
        self._reconcile_in_line: Callable[[Reservation, int], bool] | None = getattr(
            limiter, "reconcile_in_line", None)
        self._settle_in_line: Callable[[BudgetReservation, int], bool] | None = getattr(
            self.budgets, "settle_in_line", None)

    # -- who -------------------------------------------------------------------------

    @property
    def auth_required(self) -> bool:
        """Under --auth auto, off only while no key has existed (and no admin key is set) on a
        loopback bind; the first key created (even by the CLI, in another process) turns it on
        within ~2 s, for good: revoking or outliving every key leaves it on."""
        return self.auth.required(self.keys.has_held_keys())

    @property
    def auth_summary(self) -> str:
        """'on (why)' or 'off (why)': for the startup line and /ready."""
        held = self.keys.has_held_keys()
        return f"{'on' if self.auth.required(held) else 'off'} ({self.auth.reason(held)})"

    def authenticate(self, headers: dict[str, str]) -> Principal:
        """401 (with OpenAI's codes) unless the headers carry a live key; ANONYMOUS when auth is off."""
        held = self.keys.has_held_keys()
        if not self.auth.required(held):
            return ANONYMOUS
        if not held:
            raise AuthenticationError(
                f"This server requires an API key ({self.auth.reason(held)}) and has none yet, so every call is "
                "refused. Its operator creates one with `tokenway keys create --name NAME` (on the server's --db) "
                "or POST /admin/keys; send it as Authorization: Bearer KEY.", code="no_api_keys")
        # Every key revoked or expired: principal_for refuses each call (401), as for any bad key.
        return principal_for(headers, self.keys)

    # -- may they, how much ----------------------------------------------------------

    def limit_spec(self, principal: Principal) -> LimitSpec:
        d = self.defaults
        return LimitSpec(
            rpm=principal.rpm if principal.rpm is not None else d.rpm,
            tpm=principal.tpm if principal.tpm is not None else d.tpm,
            tpd=principal.tpd if principal.tpd is not None else d.tpd,
            max_concurrent=principal.max_concurrent if principal.max_concurrent is not None else d.max_concurrent,
        )

    def check_model(self, principal: Principal, model: str) -> None:
        authorize_model(principal, model)

    def service_class(self, principal: Principal, ask: TierAsk, batch_line: str | None) -> ServiceClass:
        """The tier a call runs at (gateway/tiers.py); 403 where the key may not use the one asked."""
        return resolve(ask, granted_tiers(principal, self.defaults.service_tiers), batch_line)

    def max_tokens_cap(self, principal: Principal) -> int | None:
        return principal.max_tokens if principal.max_tokens is not None else self.defaults.max_tokens

    def check_sizes(self, principal: Principal, num_messages: int, max_tokens: int | None,
                    max_tokens_param: str) -> None:
        """The checks that need no counting: size caps."""
        if num_messages > self.defaults.max_messages:
            raise InvalidRequestError(
                f"messages: {num_messages} messages exceed the limit of {self.defaults.max_messages}",
                param="messages")
        cap = self.max_tokens_cap(principal)
        if cap is not None and max_tokens is not None and max_tokens > cap:
            raise InvalidRequestError(f"{max_tokens_param}: {max_tokens} exceeds this key's cap of {cap}",
                                      param=max_tokens_param)

    async def admit(self, principal: Principal, model: str, num_prompt_tokens: int, num_completion_tokens: int,
                    n: int = 1, service_tier: ServiceClass = "default") -> Admission:
        """The budget, then the limits: the call's worst-case cost (at its tier's price) and its
        prompt + max_tokens of every choice (num_completion_tokens: max_tokens * n) are
        reserved, or it is refused with a 429 and nothing stays reserved."""
        key_id, spec = principal.key_id, self.limit_spec(principal)
        reserve_tokens = num_prompt_tokens + num_completion_tokens
        batch_share = self.defaults.batch_share if self.defaults.batch_share.applies(service_tier) else None
        share = batch_share.limits(spec) if batch_share is not None else None
        if principal.budget_usd is None:
            return Admission(await self._reserve_limits(key_id, spec, reserve_tokens, share), reserve_tokens)
        # Which prompt tokens the cache holds is known only once the call has run: uncached here.
        price = self.prices.price(model, service_tier)
        budget_nanos = nanos_down(principal.budget_usd)
        ask = _BudgetAsk(price, budget_nanos,
                         nanos_up(cost_usd(price, num_prompt_tokens, 0, num_completion_tokens)), num_prompt_tokens, n,
                         batch_share.budget_nanos(budget_nanos) if batch_share is not None else None)
        if self.joint is not None:
            try:
                return await self._reserve_both(self.joint, key_id, spec, reserve_tokens, ask, share)
            except LimitsUnavailable:
                pass  # in turn below, where each store's breaker and the policy decide, as for separate stores
        budget = await self._reserve_budget(key_id, ask)
        try:
            decision = await self._reserve_limits(key_id, spec, reserve_tokens, share)
        except BaseException:
            if budget is not None:
                self.guard.spawn(self._settle_stores(None, 0, budget, 0))
            raise
        return Admission(decision, reserve_tokens, budget)

    async def _reserve_both(self, joint: JointStore, key_id: str, spec: LimitSpec, reserve_tokens: int,
                            ask: _BudgetAsk, share: LimitSpec | None) -> Admission:
        """Both reservations in one step of the joint store; LimitsUnavailable if it cannot answer."""
        try:
            both = await self.guard.call(BOTH_STORES, lambda: joint.admit(
                key_id, spec, reserve_tokens, ask.budget_nanos, ask.worst_nanos, share, ask.share_nanos))
        except SeedUnavailable:  # the budget goes by the policy, as in _reserve_budget; the limits by their store
            decision = await self._budget_by_policy(key_id, ask)
            if decision is not None:
                raise self._budget_refusal(decision, ask) from None
            return Admission(await self._reserve_limits(key_id, spec, reserve_tokens, share), reserve_tokens)
        if both.limits is None:
            raise self._budget_refusal(both.budget, ask)
        return Admission(self._limits_verdict(both.limits, reserve_tokens), reserve_tokens, both.budget.reservation)

    async def _reserve_limits(self, key_id: str, spec: LimitSpec, reserve_tokens: int,
                              share: LimitSpec | None = None) -> Decision | None:
        try:
            decision = await self.guard.call("limits", lambda: self.limiter.admit(key_id, spec, reserve_tokens,
                                                                                  share))
        except LimitsUnavailable:
            if not spec.is_unlimited:  # a key with no limits has nothing to enforce: no policy to apply
                self.guard.by_policy()
            return None
        return self._limits_verdict(decision, reserve_tokens)

    def _limits_verdict(self, decision: Decision, reserve_tokens: int) -> Decision:
        if not decision.allowed:
            raise RateLimitError(self._refusal(decision, reserve_tokens), retry_after=decision.retry_after_s,
                                 code=f"rate_limit_exceeded_{decision.limit_kind}", limit_kind=decision.limit_kind)
        return decision

    async def _reserve_budget(self, key_id: str, ask: _BudgetAsk) -> BudgetReservation | None:
        try:
            decision = await self.guard.call("budgets", lambda: self.budgets.reserve(key_id, ask.budget_nanos,
                                                                                     ask.worst_nanos, ask.share_nanos))
        except (LimitsUnavailable, SeedUnavailable):
            decision = await self._budget_by_policy(key_id, ask)
            if decision is None:
                return None
        if decision.reservation is not None:
            return decision.reservation
        raise self._budget_refusal(decision, ask)

    async def _budget_by_policy(self, key_id: str, ask: _BudgetAsk) -> BudgetDecision | None:
        """A budget its store could not decide: 503 under closed; under open, a refusal if the
        ledger's total says the key has used it all, else None (admitted without a reservation).
        A budget is money: where the ledger cannot say what the key has spent either, the call
        is a 503 under either policy, never admitted on no figure at all."""
        self.guard.by_policy()
        try:
            spent = nanos_up(await self.ledger.spend_usd(key_id))
        except Exception as exc:  # noqa: BLE001 - whatever the ledger's failure, nothing is known
            raise ServiceUnavailableError(
                "This API key's budget cannot be checked now (its spend cannot be read); retry shortly.",
                retry_after=getattr(exc, "retry_after_s", None) or 1, code="budget_unavailable") from None
        return BudgetDecision(None, spent, 0) if spent >= ask.budget_nanos else None

    @staticmethod
    def _budget_refusal(decision: BudgetDecision, ask: _BudgetAsk) -> RateLimitError:
        budget = ask.share_nanos if decision.by_share and ask.share_nanos is not None else ask.budget_nanos
        left = budget - decision.spent_nanos  # calls in flight hold some of it: a retry may pass
        return RateLimitError(budget_refusal(ask.price, decision, budget, ask.worst_nanos,
                                             ask.num_prompt_tokens, ask.n),
                              retry_after=CONCURRENCY_RETRY_S if ask.worst_nanos <= left and left > 0 else None,
                              code="insufficient_quota", limit_kind="budget")

    async def rate_headers(self, principal: Principal) -> dict[str, str]:
        """The x-ratelimit-* headers of a response the limiter did not admit ({} while its store is down)."""
        spec = self.limit_spec(principal)
        try:
            return await self.guard.call("limits", lambda: self.limiter.headers(principal.key_id, spec))
        except LimitsUnavailable:
            return {}

    def _refusal(self, decision: Decision, reserve_tokens: int) -> str:
        kind = decision.limit_kind
        share = (f" in this key's batch share ({self.defaults.batch_share.fraction:.0%} of its limits: what its "
                 "batch lines may use)") if decision.by_share else ""
        if decision.retry_after_s is None:
            return (f"This request needs {reserve_tokens} tokens (prompt + max_tokens), more than this key's "
                    f"{kind} limit allows{share}; lower max_tokens.")
        return f"Rate limit reached for {kind}{share}; retry after {decision.retry_after_s:.1f} s."

    # -- what it cost ----------------------------------------------------------------

    def cost_usd(self, model: str, outcome: CallOutcome, service_tier: ServiceClass = "default") -> float:
        price = self.prices.price(model, service_tier)
        if outcome.response_cache == "hit":
            return response_cache_cost_usd(price, outcome.prompt_tokens, outcome.completion_tokens)
        return cost_usd(price, outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)

    def call_cost_usd(self, call: Call, outcome: CallOutcome) -> float:
        """What the call's outcome cost at the tier it ran at: its ledger row's and its trace's."""
        return self.cost_usd(call.model, outcome, call_tier(call))

    def _settle(self, admission: Admission | None, outcome: CallOutcome, cost: float) -> None:
        """Turn the call's reservations into what it used (tokens) and billed (cost), in the background."""
        if admission is None:
            return
        reservation = admission.decision.reservation if admission.decision is not None else None
        if reservation is None and admission.budget is None:
            return
        used_tokens = outcome.prompt_tokens + outcome.completion_tokens
        if reservation is not None and self._reconcile_in_line is not None \
                and self._reconcile_in_line(reservation, used_tokens):
            reservation = None
        budget = admission.budget
        if budget is not None and self._settle_in_line is not None and self._settle_in_line(budget, nanos_up(cost)):
            budget = None
        if reservation is not None or budget is not None:
            self.guard.spawn(self._settle_stores(reservation, used_tokens, budget, nanos_up(cost)))

    async def _settle_stores(self, reservation: Reservation | None, used_tokens: int,
                             budget: BudgetReservation | None, used_nanos: int) -> None:
        # Kept and replayed if a store is down: a reconcile or settle of a reservation its store
        # no longer holds is harmless (budgets_redis.py: the epoch).
        joint = self.joint
        if joint is not None and budget is not None and reservation is not None:
            await self.guard.settle(BOTH_STORES, lambda: joint.settle(budget, used_nanos, reservation, used_tokens))
            return
        if budget is not None:
            await self.guard.settle("budgets", lambda: self.budgets.settle(budget, used_nanos))
        if reservation is not None:
            await self.guard.settle("limits", lambda: self.limiter.reconcile(reservation, used_tokens))

    def usage_record(self, call: Call, outcome: CallOutcome, cost: float | None = None) -> UsageRecord:
        """The ledger row, with the call's trace as of now (the commit is the billing stage)."""
        trace = Trace.of_call(call, outcome, self.call_cost_usd(call, outcome) if cost is None else cost)
        return UsageRecord(
            request_id=call.request_id,
            key_id=call.start.principal.key_id,
            model=call.model,
            prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens,
            completion_tokens=outcome.completion_tokens,
            reasoning_tokens=outcome.reasoning_tokens,
            cost_usd=trace.cost_usd,
            finish_reason=outcome.finish_reason,
            error=outcome.error,
            status=outcome.status,
            stages_ms=trace.stages_ms,
            started_at=call.start.started_at,
            finished_at=time.time(),
            trace=trace.ledger_fields(),
            service_tier=call_tier(call),
        )

    def _final_row(self, call: Call, status: int) -> UsageRecord | None:
        """The call's one row, the first time it is asked for (None after): settles its reservations too.
        `status` is what was sent, for a call that ended without an outcome of its own."""
        if call.committed:
            return None
        call.committed = True
        call.end_as_sent(status)
        outcome = call.outcome
        assert outcome is not None, "end_as_sent() leaves every call with an outcome"
        call.clock.start_billing()
        cost = self.call_cost_usd(call, outcome)
        self._settle(call.admission, outcome, cost)
        if call.deferred:  # the line runs again under the same id: its row is the attempt it ends with
            return None
        return self.usage_record(call, outcome, cost)

    async def commit(self, call: Call, status: int = 0) -> None:
        """Write the call's one ledger row and wait until it is durable."""
        row = self._final_row(call, status)
        if row is not None:
            await self.ledger.record(row)

    def commit_nowait(self, call: Call, status: int = 0) -> None:
        """The same, for a call whose client is gone (nothing to hold back)."""
        row = self._final_row(call, status)
        if row is not None:
            self.ledger.record_nowait(row)

    async def close(self) -> None:
        await self.guard.close()  # the last settlements, before their stores close
        await self.ledger.close()
        await self.limiter.close()
        await self.budgets.close()
        await asyncio.to_thread(self.keys.close)  # when each key was last used, written once more


def budget_refusal(price: ModelPrice, decision: BudgetDecision, budget: int, worst: int, num_prompt_tokens: int,
                   n: int) -> str:
    """What a call refused by its key's budget is told: the budget, what remains, and what would fit."""
    spent, held = decision.spent_nanos, decision.held_nanos
    left = budget - spent
    if left <= 0:
        if decision.by_share:
            return (f"This API key's batch lines have used their share of its budget: {format_usd(spent)} of "
                    f"{format_usd(budget)} spent, nothing remains for them.")
        return f"This API key has used its budget: {format_usd(spent)} of {format_usd(budget)} spent, nothing remains."
    cost = (f"This request may cost up to {format_usd(worst)} (its prompt and max_tokens at the model's price, "
            f"the prompt uncached)")
    remains = (f"{format_usd(left)} that remains of the batch share ({format_usd(budget)}) of this API key's "
               "budget" if decision.by_share else f"{format_usd(left)} that remains of this API key's "
               f"{format_usd(budget)} budget")
    if worst <= left:
        return f"{cost}; of the {remains}, {format_usd(held)} is held by its calls in flight. Retry when they finish."
    fit = max_tokens_within(price, num_prompt_tokens, n, left)
    return f"{cost}, more than the {remains}" + (f"; lower max_tokens to {fit} or less." if fit else ".")


def max_tokens_within(price: ModelPrice, num_prompt_tokens: int, n: int, left: int) -> int:
    """The largest max_tokens whose worst case (n choices) costs at most `left` nanos; 0: none does."""
    if price.output <= 0 or nanos_up(cost_usd(price, num_prompt_tokens, 0, n)) > left:
        return 0
    def fits(max_tokens: int) -> bool:
        return nanos_up(cost_usd(price, num_prompt_tokens, 0, max_tokens * n)) <= left

    # From the float estimate to the exact answer, in a step or two either way.
    max_tokens = max(1, int((left / 1e9 - cost_usd(price, num_prompt_tokens, 0, 0)) * 1e6 / (price.output * n)))
    while max_tokens > 1 and not fits(max_tokens):
        max_tokens -= 1
    while fits(max_tokens + 1):
        max_tokens += 1
    return max_tokens
