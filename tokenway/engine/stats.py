"""EngineStats: what the engine publishes of itself (as vLLM's SchedulerStats), made once a
step by the engine and read by everything above it as the same frozen value.

    EngineCore.snapshot() ─► EngineStats ─(pickled, in each step's message)─► ProcessEngine
        ─► + engine_pid, engine_restarts (dataclasses.replace) ─► EngineClient.stats()
              ├─► server/stats.py ServerStats ─► /engine/stats; the Observer's gauges and dashboard
              └─► worker_api.py /worker/v1/state "engine" ─(JSON)─► WorkerReplica: from_dict

The field list lives here only: the payload's keys, their order and the JSON parse follow it.
`classes` is the same counts per service class (ClassStats), the payload's
{"classes": {"priority": {...}, "default": {...}, "flex": {...}, "batch": {...}}}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import UnionType
from typing import Any, get_args, get_type_hints

from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass


@dataclass(frozen=True, slots=True)
class ClassStats:
    """One service class's share of the engine: what of it runs and waits now, and its totals
    since start (preemptions, prompt tokens of its requests admitted, tokens generated)."""

    service_class: ServiceClass
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generated_tokens: int

    def to_dict(self) -> dict[str, int]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)[1:]}

    @classmethod
    def from_dict(cls, service_class: ServiceClass, payload: object) -> ClassStats:
        if not isinstance(payload, Mapping):
            raise ValueError(f"classes.{service_class}: expected an object, got {type(payload).__name__}")
        counts = []
        for field in dataclasses.fields(cls)[1:]:
            value = payload.get(field.name)
            if type(value) is not int:  # a bool is never a count
                if field.name not in payload:
                    raise ValueError(f"classes.{service_class}.{field.name}: missing")
                raise ValueError(f"classes.{service_class}.{field.name}: expected int, got {type(value).__name__}")
            counts.append(value)
        return cls(service_class, *counts)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counts (what runs, what waits, how full the KV cache is; totals since start),
    and its process's where it steps in one of its own. Field order is the payload's key order."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float  # hit / queried tokens; 0.0 before any lookup
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_acceptance_rate: float  # accepted / drafted tokens; 0.0 before any draft
    spec_decode_mean_accepted_length: float
    # One per class, in SERVICE_CLASSES order (best first); None where the engine reports none
    # (a worker older than service classes).
    classes: tuple[ClassStats, ...] | None = None
    # Steps run between two layers of a step that carried batch work (engine/core.py step()).
    num_interjected_steps: int = 0
    engine_pid: int | None = None  # None (both): the engine steps in a thread of this process
    engine_restarts: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The payload (/engine/stats, a worker's state): every field in order, engine_pid and
        engine_restarts only where the engine runs in a process of its own."""
        stats: dict[str, Any] = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        if self.classes is None:
            del stats["classes"]
        else:
            stats["classes"] = {entry.service_class: entry.to_dict() for entry in self.classes}
        if self.engine_pid is None and self.engine_restarts is None:
            del stats["engine_pid"], stats["engine_restarts"]
        return stats

    def of_class(self, service_class: ServiceClass) -> ClassStats | None:
        if self.classes is None:
            return None
        return self.classes[SERVICE_CLASSES.index(service_class)]

    @classmethod
    def from_dict(cls, payload: Mapping[str, object]) -> EngineStats:
        """to_dict's inverse, for stats that crossed as JSON (a worker's state). Raises ValueError
        naming the first count that is missing or not a number of its type; keys it does not
        know are ignored (a newer engine's counts)."""
        values: dict[str, Any] = {}  # each checked against its field's type below
        for name, kinds in _FIELD_KINDS:
            value = payload.get(name)
            # A bool is an int to isinstance, and never a count.
            if isinstance(value, bool) or not isinstance(value, kinds):
                if name not in payload:
                    raise ValueError(f"{name}: missing")
                raise ValueError(f"{name}: expected {' or '.join(kind.__name__ for kind in kinds)}, "
                                 f"got {type(value).__name__}")
            values[name] = value
        classes = payload.get("classes")
        if classes is not None:
            if not isinstance(classes, Mapping):
                raise ValueError(f"classes: expected an object, got {type(classes).__name__}")
            parsed = []
            for name in SERVICE_CLASSES:  # a class it does not know (a newer engine's) is ignored
                if name not in classes:
                    raise ValueError(f"classes.{name}: missing")
                parsed.append(ClassStats.from_dict(name, classes[name]))
            values["classes"] = tuple(parsed)
        return cls(**values)


def _field_kinds() -> tuple[tuple[str, tuple[type, ...]], ...]:
    """(field, the types its JSON value may have), in field order: its annotation's (None where
    it says `| None`: absent means None), and int wherever float (0.0 may come as 0)."""
    hints = get_type_hints(EngineStats)
    kinds = []
    for field in dataclasses.fields(EngineStats):
        if field.name == "classes":  # parsed on its own (ClassStats.from_dict)
            continue
        hint = hints[field.name]
        types = get_args(hint) if isinstance(hint, UnionType) else (hint,)
        kinds.append((field.name, (*types, int) if float in types else types))
    return tuple(kinds)


_FIELD_KINDS = _field_kinds()
