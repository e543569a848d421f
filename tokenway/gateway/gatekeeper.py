"""Stages 1 and 7 around every API call: who is calling, may they, how much, what it cost.

    socket ─► GatewayMiddleware ─► authenticate (key → Principal) ─► route: parse, tokenize
          ─► admit (model allowed? budget left? limits reserve prompt + max_tokens) ─► engine
          ─► finish: reconcile the reservation to the tokens used, price the usage
          ─► the ledger row is committed before the response's last byte leaves

The call's facts come as frozen values (server/call.py): admit() makes the Admission, and the
one ledger row is derived from the call's CallOutcome, whatever happened (completed, refused,
failed, or the client gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from tokenway.billing.ledger import Ledger, UsageRecord
from tokenway.billing.pricing import PriceTable, cost_usd
from tokenway.gateway.auth import ANONYMOUS, KeyStore, Principal, authorize_model, needs_auth, principal_for
from tokenway.gateway.limits import Decision, Limiter, LimitSpec
from tokenway.observability.traces import Trace
from tokenway.protocol.errors import AuthenticationError, InvalidRequestError, RateLimitError
from tokenway.server.call import Call, CallOutcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admission:
    """Gatekeeper.admit's answer for an admitted call: the limiter's reservation (settled
    against the tokens used when the call ends) and the x-ratelimit-* headers to send."""

    decision: Decision
    reserved_tokens: int

    @property
    def rate_headers(self) -> dict[str, str]:
        return self.decision.headers


@dataclass(slots=True)
class Defaults:
    """Limits for keys that set none (and for the anonymous caller when auth is off)."""

    rpm: int | None = None
    tpm: int | None = None
    tpd: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None
    max_messages: int = 2048


class Gatekeeper:
    def __init__(self, keys: KeyStore, limiter: Limiter, ledger: Ledger, prices: PriceTable, defaults: Defaults,
                 host: str) -> None:
        self.keys = keys
        self.limiter = limiter
        self.ledger = ledger
        self.prices = prices
        self.defaults = defaults
        self.host = host

    # -- who -------------------------------------------------------------------------

    @property
    def auth_required(self) -> bool:
        """Auth may stay off only while no key exists and the server binds loopback; the
        first key created (even by the CLI, in another process) turns it on within ~2 s."""
        return needs_auth(self.keys.count_active(), self.host)

    def authenticate(self, headers: dict[str, str]) -> Principal:
        """401 (with OpenAI's codes) unless the headers carry a live key; ANONYMOUS when auth is off."""
        num_keys = self.keys.count_active()
        if not needs_auth(num_keys, self.host):
            return ANONYMOUS
        if num_keys == 0:
            raise AuthenticationError(
                f"This server listens on {self.host}, beyond loopback, and has no API key yet, so every call is "
                "refused. Its operator creates one with `tokenway keys create --name NAME` (on the server's --db); "
                "send it as Authorization: Bearer KEY.", code="no_api_keys")
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

    async def admit(self, principal: Principal, reserve_tokens: int) -> Admission:
        """Budget, then the limits, reserving prompt + max_tokens of every choice; 429 when refused."""
        if principal.budget_usd is not None:
            spent = await self.ledger.spend_usd(principal.key_id)
            if spent >= principal.budget_usd:
                raise RateLimitError(
                    f"This API key has used its budget (${spent:.4f} of ${principal.budget_usd:.4f}).",
                    code="insufficient_quota", limit_kind="budget")
        decision = await self.limiter.admit(principal.key_id, self.limit_spec(principal), reserve_tokens)
        if not decision.allowed:
            raise RateLimitError(self._refusal(decision, reserve_tokens), retry_after=decision.retry_after_s,
                                 code=f"rate_limit_exceeded_{decision.limit_kind}", limit_kind=decision.limit_kind)
        return Admission(decision, reserve_tokens)

    @staticmethod
    def _refusal(decision: Decision, reserve_tokens: int) -> str:
        kind = decision.limit_kind
        if decision.retry_after_s is None:
            return (f"This request needs {reserve_tokens} tokens (prompt + max_tokens), more than this key's "
                    f"{kind} limit allows; lower max_tokens.")
        return f"Rate limit reached for {kind}; retry after {decision.retry_after_s:.1f} s."

    # -- what it cost ----------------------------------------------------------------

    def cost_usd(self, model: str, outcome: CallOutcome) -> float:
        return cost_usd(self.prices.price(model), outcome.prompt_tokens, outcome.cached_tokens,
                        outcome.completion_tokens)

    def _settle(self, admission: Admission | None, outcome: CallOutcome) -> None:
        """Give back the unused part of the call's reservation."""
        if admission is None or admission.decision.reservation is None:
            return
        used = outcome.prompt_tokens + outcome.completion_tokens
        asyncio.get_running_loop().create_task(self.limiter.reconcile(admission.decision.reservation, used))

    def usage_record(self, call: Call, outcome: CallOutcome) -> UsageRecord:
        """The ledger row, with the call's trace as of now (the commit is the billing stage)."""
        trace = Trace.of_call(call, outcome, self.cost_usd(call.model, outcome))
        return UsageRecord(
            request_id=call.request_id,
            key_id=call.start.principal.key_id,
            model=call.model,
            prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens,
            completion_tokens=outcome.completion_tokens,
            cost_usd=trace.cost_usd,
            finish_reason=outcome.finish_reason,
            error=outcome.error,
            status=outcome.status,
            stages_ms=trace.stages_ms,
            started_at=call.start.started_at,
            finished_at=time.time(),
            trace=trace.ledger_fields(),
        )

    def _final_row(self, call: Call, status: int) -> UsageRecord | None:
        """The call's one row, the first time it is asked for (None after): settles the limits too.
        `status` is what was sent, for a call that ended without an outcome of its own."""
        if call.committed:
            return None
        call.committed = True
        call.end_as_sent(status)
        call.clock.start_billing()
        self._settle(call.admission, call.outcome)
        return self.usage_record(call, call.outcome)

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
        await self.ledger.close()
        await self.limiter.close()
