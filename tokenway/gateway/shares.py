"""The batch class's share of a key's limits and budget.

    Gatekeeper.admit(service_tier="batch") ─► BatchShare.limits(spec), BatchShare.budget_nanos(budget)
        ─► Limiter.admit(..., share), BudgetStore.reserve(..., share_nanos): the call counts
           against the key's whole quota and against the share, held in both or in neither

A key's other calls count against its whole quota, as they always did; its batch lines
(service class "batch": a Batch API line) against the whole and the share too. So a batch,
however large, never holds more than the share of any limit, and the key's interactive
calls always find at least the rest; while no batch runs they have the whole.

The share is `batch_limit_share` of each of the key's limits (RPM, TPM, TPD, max_concurrent)
and of its budget_usd, rounded down but never to nothing: a limit of 1 leaves its share 1,
or the key's batch lines could never run. A fraction of 1 is no share at all (batch lines
count as any call does). Limits are windows, and the share's starts empty; the budget is
spent for good, so the share's spend is seeded from the ledger's batch rows (batch_spend_seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenway.billing.ledger import Ledger
from tokenway.gateway.budgets import SpendSeed
from tokenway.gateway.limits import LimitSpec
from tokenway.protocol.errors import FieldError
from tokenway.protocol.job import ServiceClass

SHARED_CLASS: ServiceClass = "batch"  # the class whose calls count against the share
DEFAULT_BATCH_LIMIT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class BatchShare:
    fraction: float = DEFAULT_BATCH_LIMIT_SHARE

    def __post_init__(self) -> None:
        if (isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float)
                or not 0 < self.fraction <= 1):
            raise FieldError("batch_limit_share", f"must be a fraction in (0, 1], got {self.fraction!r}")

    def applies(self, service_class: ServiceClass) -> bool:
        return service_class == SHARED_CLASS and self.fraction < 1

    def limits(self, spec: LimitSpec) -> LimitSpec | None:
        """The share's limits; None where there is nothing to share (no limits, or all of them)."""
        if self.fraction >= 1 or spec.is_unlimited:
            return None
        return LimitSpec(rpm=self._part(spec.rpm), tpm=self._part(spec.tpm), tpd=self._part(spec.tpd),
                         max_concurrent=self._part(spec.max_concurrent))

    def budget_nanos(self, budget_nanos: int) -> int | None:
        """The share of a budget in nanos, rounded down; None for a fraction of 1."""
        if self.fraction >= 1:
            return None
        return math.floor(round(budget_nanos * self.fraction, 6))

    def _part(self, limit: int | None) -> int | None:
        # round() first: 100 * 0.29 is 28.999999999999996 in floats
        return None if limit is None else max(1, math.floor(round(limit * self.fraction, 6)))


def batch_spend_seed(ledger: Ledger) -> SpendSeed:
    """What a key's batch lines have cost, from the ledger's committed rows: the seed of its
    share's spend. Rows this process has not committed yet are not in it; the share is seeded
    once per key and process (per state lost, with Redis), when they are few."""

    async def spend_usd(key_id: str) -> float:
        rows = await ledger.usage(key_id)
        return sum(float(row["cost_usd"] or 0) for row in rows if row["service_tier"] == SHARED_CLASS)

    return spend_usd
