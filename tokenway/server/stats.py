"""GET /engine/stats, typed where the server builds it (as vLLM's SchedulerStats):

    EngineClient.stats() (a dict, engine/) ─► EngineStats      the local engine's counts
    Router.stats()                         ─► replicas         pool -> replica -> load and health
    Capacity.num_in_flight                 ─► num_pending_http
                                           ─► ServerStats ─► to_dict(): the payload, also what the
                                              Observer's metrics and dashboard read

A key sees its models' pools as totals (pool_totals): no replica, no host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenway.engine.client import EngineClient
from tokenway.routing.router import Router


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The local engine's published counts (EngineCore.snapshot), and its process's where it
    steps in one (ProcessEngine); field order is the payload's key order."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_acceptance_rate: float
    spec_decode_mean_accepted_length: float
    engine_pid: int | None = None  # None: the engine steps in a thread of this process
    engine_restarts: int | None = None

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, Any]) -> EngineStats:
        """The engine's dict, taken at the boundary: a count it does not publish is a KeyError here."""
        s = snapshot
        return cls(s["num_running"], s["num_waiting"], s["kv_blocks_total"], s["kv_blocks_free"],
                   s["prefix_cache_hit_rate"], s["prefix_cache_queried_tokens"], s["prefix_cache_hit_tokens"],
                   s["num_preemptions"], s["num_steps"], s["spec_decode_num_drafts"],
                   s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"],
                   s["spec_decode_acceptance_rate"], s["spec_decode_mean_accepted_length"], s.get("engine_pid"),
                   s.get("engine_restarts"))

    def to_dict(self) -> dict[str, Any]:
        stats = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.engine_pid is None and self.engine_restarts is None:
            del stats["engine_pid"], stats["engine_restarts"]
        return stats


@dataclass(frozen=True, slots=True)
class ServerStats:
    engine: EngineStats | None  # None: a gateway only (no local engine)
    num_pending_http: int  # engine requests of the HTTP calls in flight (Capacity)
    replicas: dict[str, dict[str, dict]]  # Router.stats(): pool -> replica -> its load and health

    @classmethod
    def read(cls, engine: EngineClient | None, router: Router, num_pending_http: int) -> ServerStats:
        return cls(EngineStats.from_snapshot(engine.stats()) if engine is not None else None, num_pending_http,
                   router.stats())

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
