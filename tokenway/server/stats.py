"""GET /engine/stats: what the server publishes of itself, typed.

    EngineClient.stats() (engine/stats.py)  ─► EngineStats      the local engine's counts
    Router.stats()                          ─► replicas         pool -> replica -> load and health
    Capacity.num_in_flight                  ─► num_pending_http
                                            ─► ServerStats ─► to_dict(): the payload; the Observer
                                               reads it too (its metrics and dashboard)

A key sees its models' pools as totals (pool_totals): no replica, no host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenway.engine.client import EngineClient
from tokenway.engine.stats import EngineStats
from tokenway.routing.router import Router


@dataclass(frozen=True, slots=True)
class ServerStats:
    """The payload of GET /engine/stats as one value, read when asked (Services.stats); the
    Observer takes it as its ServedStats."""

    engine: EngineStats | None  # None: a gateway only (no local engine)
    num_pending_http: int  # engine requests of the HTTP calls in flight (Capacity)
    replicas: dict[str, dict[str, dict]]  # Router.stats(): pool -> replica -> its load and health

    @classmethod
    def read(cls, engine: EngineClient | None, router: Router, num_pending_http: int) -> ServerStats:
        return cls(engine.stats() if engine is not None else None, num_pending_http, router.stats())

    def to_dict(self) -> dict[str, Any]:
        engine = self.engine.to_dict() if self.engine is not None else {}
        return {**engine, "num_pending_http": self.num_pending_http, "replicas": self.replicas}

    def with_pool_totals(self, shown: set[str]) -> dict[str, Any]:
        """The payload with each pool's replicas as totals, of the pools `shown` only."""
        return {**self.to_dict(), "replicas": pool_totals(self.replicas, shown)}


def pool_totals(pool_to_replicas: Mapping[str, Mapping[str, Mapping[str, Any]]], shown: set[str]
                ) -> dict[str, dict[str, int]]:
    """Router.stats() without the replicas' names: per pool (of those `shown`), how many
    replicas, how many available, and their calls and tokens in flight."""
    return {pool: {"num_replicas": len(replicas),
                   "num_available": sum(r["available"] for r in replicas.values()),
                   "num_in_flight": sum(r["num_in_flight"] for r in replicas.values()),
                   "num_outstanding_tokens": sum(r["num_outstanding_tokens"] for r in replicas.values())}
            for pool, replicas in pool_to_replicas.items() if pool in shown}
