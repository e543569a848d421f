"""Stages 1 and 7 around every API call: who is calling, may they, how much, what it cost.

    socket ─► GatewayMiddleware ─► authenticate (key → Principal) ─► route: parse, tokenize
          ─► admit (model allowed? budget left? limits reserve prompt + max_tokens) ─► engine
          ─► finish: reconcile the reservation to the tokens used, price the usage
          ─► the ledger row is committed before the response's last byte leaves

One CallRecord per HTTP request lives in the ASGI scope; the route fills in usage as it
learns it, and the middleware writes exactly one ledger row from it, whatever happened
(completed, refused, failed, or the client gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from tokenway.billing.ledger import Ledger, UsageRecord
from tokenway.billing.pricing import PriceTable, cost_usd
from tokenway.gateway.auth import ANONYMOUS, KeyStore, Principal, authorize_model, needs_auth, principal_for
from tokenway.gateway.limits import Decision, Limiter, LimitSpec
from tokenway.observability.traces import Trace
from tokenway.protocol.errors import AuthenticationError, InvalidRequestError, RateLimitError
from tokenway.stages import StageClock

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CallRecord:
    """What the ledger row for one HTTP request will say; filled in along the way."""

    started_at: float = field(default_factory=time.time)
    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex}")  # the route's id replaces it
    status: int | None = None  # overrides the HTTP status (499: the client left mid-stream)
    principal: Principal = ANONYMOUS
    model: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    decision: Decision | None = None  # the limiter's admission, held until reconciled
    reconciled: bool = False
    rate_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the response
    committed: bool = False  # the ledger row is written
    # For the trace (observability/traces.py) besides the ledger's fields:
    endpoint: str = ""
    stream: bool = False
    num_choices: int = 1
    max_choice_tokens: int = 0  # the longest choice's completion tokens (TPOT is per choice)
    cache_reason: str | None = None
    limit_kind: str | None = None  # the limit that refused the call with a 429
    sampling: dict = field(default_factory=dict)
    cost_usd: float = 0.0
    traceparent: str | None = None


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

    async def admit(self, record: CallRecord, reserve_tokens: int) -> Decision:
        principal = record.principal
        if principal.budget_usd is not None:
            spent = await self.ledger.spend_usd(principal.key_id)
            if spent >= principal.budget_usd:
                record.limit_kind = "budget"
                raise RateLimitError(
                    f"This API key has used its budget (${spent:.4f} of ${principal.budget_usd:.4f}).",
                    code="insufficient_quota")
        decision = await self.limiter.admit(principal.key_id, self.limit_spec(principal), reserve_tokens)
        record.rate_headers = decision.headers
        if not decision.allowed:
            record.limit_kind = decision.limit_kind
            raise RateLimitError(self._refusal(decision, reserve_tokens), retry_after=decision.retry_after_s,
                                 code=f"rate_limit_exceeded_{decision.limit_kind}")
        record.decision = decision
        return decision

    @staticmethod
    def _refusal(decision: Decision, reserve_tokens: int) -> str:
        kind = decision.limit_kind
        if decision.retry_after_s is None:
            return (f"This request needs {reserve_tokens} tokens (prompt + max_tokens), more than this key's "
                    f"{kind} limit allows; lower max_tokens.")
        return f"Rate limit reached for {kind}; retry after {decision.retry_after_s:.1f} s."

    # -- what it cost ----------------------------------------------------------------

    def settle(self, record: CallRecord) -> None:
        """The request is over: give back the unused part of its reservation (once)."""
        if record.decision is None or record.reconciled or record.decision.reservation is None:
            return
        record.reconciled = True
        used = record.prompt_tokens + record.completion_tokens
        asyncio.get_running_loop().create_task(self.limiter.reconcile(record.decision.reservation, used))

    def usage_record(self, record: CallRecord, status: int, clock: StageClock) -> UsageRecord:
        """The ledger row, with the call's trace as of now (the commit is the billing stage)."""
        price = self.prices.price(record.model)
        record.cost_usd = cost_usd(price, record.prompt_tokens, record.cached_tokens, record.completion_tokens)
        trace = Trace.of_call(record, clock, status)
        return UsageRecord(
            request_id=record.request_id,
            key_id=record.principal.key_id,
            model=record.model,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
            cost_usd=record.cost_usd,
            finish_reason=record.finish_reason,
            error=record.error,
            status=record.status or status,
            stages_ms=trace.stages_ms,
            started_at=record.started_at,
            finished_at=time.time(),
            trace=trace.ledger_fields(),
        )

    def _final_row(self, record: CallRecord, status: int, clock: StageClock) -> UsageRecord | None:
        """The call's one row, the first time it is asked for (None after): settles the limits too."""
        if record.committed:
            return None
        record.committed = True
        clock.start_billing()
        self.settle(record)
        return self.usage_record(record, status, clock)

    async def commit(self, record: CallRecord, status: int, clock: StageClock) -> None:
        """Write the request's one ledger row and wait until it is durable."""
        row = self._final_row(record, status, clock)
        if row is not None:
            await self.ledger.record(row)

    def commit_nowait(self, record: CallRecord, status: int, clock: StageClock) -> None:
        """The same, for a request whose client is gone (nothing to hold back)."""
        row = self._final_row(record, status, clock)
        if row is not None:
            self.ledger.record_nowait(row)

    async def close(self) -> None:
        await self.ledger.close()
        await self.limiter.close()
