"""The model registry: the names this gateway serves and the pool of replicas behind each.

    config file ──tomllib──► dict ──Registry.from_config──► Registry: ModelEntry ... (registry_config.py)
    a request's "model" ──resolve──► ModelEntry ──fallback_chain──► (it, its fallbacks ...)
        each entry ──► its pool: a Balancer over its ReplicaSpecs, made into replicas at start
    GET /v1/models ◄── served_names()

The registry's keys sit at the config file's top level beside `tokenway serve`'s flags
(REGISTRY_KEYS; load_config_file reads the flags and skips these):

    [[models]] ... [[models.replicas]] ...   the served models (registry_config.py has every key)
    embeddings = false                        serve no embeddings model (default true)

No [[models]] in the file, or no file: today's server. One local chat model, named by
--served-model-name (the first name; the others are its aliases) or after --model, plus
all-MiniLM-L6-v2 for /v1/embeddings, served locally. That embeddings model is also added to a
[[models]] list that has none of its own, unless `embeddings = false`. implicit_names lists
the models the config did not list: the server may start without the implicit embeddings model
(with a warning) when its package is not installed.

Checked here, across models: every name and alias names one model; fallbacks name known models
(by name or alias) of the same kind, and never lead back to a model (no cycles); at most one
model of each kind has a local replica, as this process runs one chat engine and one embeddings
engine. fallback_chain is breadth first: a model's own fallbacks in the order written, then
theirs. Whether a call moves down the chain (a pool down or full) is the router's decision.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenway.billing.pricing import ModelPrice, PriceTable
from tokenway.config import DEFAULT_EMBEDDING_MODEL
from tokenway.routing.registry_config import ModelEntry, ModelKind, ReplicaSpec, a
from tokenway.routing.registry_toml import Table, at, parse_model

REGISTRY_KEYS = frozenset({"models", "embeddings"})


class ModelNotFound(KeyError):
    """No served model has this name or alias: the caller answers 404 model_not_found."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model

    def __str__(self) -> str:  # KeyError's own would show repr(args)
        return f"The model {self.model!r} does not exist."


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model as GET /v1/models lists it."""

    name: str
    aliases: tuple[str, ...]
    kind: ModelKind
    context_window: int | None  # None: the engine's or worker's own, known once it runs


def default_served_name(model: str) -> str:
    """The name a model is served under when none is given: a .gguf file's stem, a directory's
    name (whole: Qwen2.5-0.5B-Instruct keeps its dots), an alias itself."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True, slots=True)
class Registry:
    models: tuple[ModelEntry, ...]  # the config's [[models]] in order, then the implicit ones
    implicit_names: frozenset[str] = frozenset()  # models the config did not list (the defaults)
    _name_to_model: dict[str, ModelEntry] = field(init=False, repr=False, compare=False)
    _name_to_chain: dict[str, tuple[ModelEntry, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        name_to_index: dict[str, int] = {}
        for i, entry in enumerate(self.models):
            for j, name in enumerate(entry.names):
                other = name_to_index.setdefault(name, i)
                if other != i:
                    role = "the name" if self.models[other].name == name else "an alias"
                    key = "name" if j == 0 else f"aliases[{j - 1}]"
                    raise ValueError(f"{self._where(i)}.{key}: {name!r} is already {role} of {self._where(other)}")
        edges = [self._fallback_indexes(i, name_to_index) for i in range(len(self.models))]
        self._check_no_cycle(edges)
        self._check_local_engines()
        object.__setattr__(self, "_name_to_model", {name: self.models[i] for name, i in name_to_index.items()})
        object.__setattr__(self, "_name_to_chain", {
            entry.name: tuple(self.models[k] for k in _breadth_first(i, edges))
            for i, entry in enumerate(self.models)})

    @classmethod
    def from_config(cls, data: Mapping[str, Any], *, default_model: str,
                    served_model_names: Sequence[str] | None = None) -> Registry:
        """data: the parsed config file ({} without one); only REGISTRY_KEYS are read.
        default_model, served_model_names: serve's --model and --served-model-name."""
        embeddings = data.get("embeddings", True)
        if not isinstance(embeddings, bool):
            raise ValueError(f"embeddings: must be true or false, got {embeddings!r}")  # noqa: TRY004 - cli reports ValueErrors
        if data.get("models") is None:
            names = list(served_model_names or [default_served_name(default_model)])
            with at("served_model_name"):
                models = [ModelEntry(names[0], (ReplicaSpec("local", model=default_model),), aliases=tuple(names[1:]))]
            implicit_names = {names[0]}
        else:
            if served_model_names:
                raise ValueError("served_model_name: not used with [[models]]; give the local model's names there "
                                 "(name, aliases)")
            if not isinstance(data["models"], list) or not data["models"]:
                raise ValueError("models: must be one or more [[models]] tables (leave it out for the default model)")
            models = [parse_model(Table(f"models[{i}]", table), default_model)
                      for i, table in enumerate(data["models"])]
            implicit_names = set()
        listed = next((i for i, entry in enumerate(models) if entry.kind == "embeddings"), None)
        if not embeddings and listed is not None:
            raise ValueError(f"embeddings: false, but models[{listed}] is an embeddings model; drop one of the two")
        if embeddings and listed is None:
            taken = next((i for i, entry in enumerate(models) if DEFAULT_EMBEDDING_MODEL in entry.names), None)
            if taken is not None:
                where = f"models[{taken}]" if data.get("models") is not None else "served_model_name"
                raise ValueError(f"{where}: {DEFAULT_EMBEDDING_MODEL!r} is the default embeddings model's name, "
                                 "served as the config lists no embeddings model; list it with kind = \"embeddings\", "
                                 "or set embeddings = false")
            models.append(ModelEntry(DEFAULT_EMBEDDING_MODEL, (ReplicaSpec("local"),), "embeddings"))
            implicit_names.add(DEFAULT_EMBEDDING_MODEL)
        return cls(tuple(models), frozenset(implicit_names))

    @classmethod
    def load(cls, path: str | Path, *, default_model: str, served_model_names: Sequence[str] | None = None) -> Registry:
        """from_config of a TOML file; every error names the file."""
        try:
            data = tomllib.loads(Path(path).read_text())
            return cls.from_config(data, default_model=default_model, served_model_names=served_model_names)
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the config file: {exc.strerror}") from None
        except ValueError as exc:  # tomllib.TOMLDecodeError is one
            raise ValueError(f"{path}: {exc}") from None

    # ---- lookups ---------------------------------------------------------------------------------

    def get(self, name: str) -> ModelEntry | None:
        """The model a name or alias refers to; None if none."""
        return self._name_to_model.get(name)

    def resolve(self, name: str) -> ModelEntry:
        """get, raising ModelNotFound (a KeyError) for an unknown name."""
        entry = self._name_to_model.get(name)
        if entry is None:
            raise ModelNotFound(name)
        return entry

    def served_names(self) -> tuple[ServedModel, ...]:
        """Each model once, in config order, with its aliases: for GET /v1/models."""
        return tuple(ServedModel(m.name, m.aliases, m.kind, m.context_window) for m in self.models)

    def fallback_chain(self, name: str) -> tuple[ModelEntry, ...]:
        """The model a name or alias refers to, then the models to try when its pool is down or
        full: its fallbacks in order, then theirs (breadth first), each once."""
        return self._name_to_chain[self.resolve(name).name]

    def local_models(self) -> tuple[ModelEntry, ...]:
        """The models this process serves itself (at most one chat, one embeddings)."""
        return tuple(m for m in self.models if m.local_replica is not None)

    def local_model(self, kind: ModelKind) -> ModelEntry | None:
        """The model of this kind with a local replica: what this process's engine loads."""
        return next((m for m in self.local_models() if m.kind == kind), None)

    def env_keys_missing(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """The variables replicas read their keys from that are unset or blank, sorted. Names
        only: the server warns with these, and never logs a key's value."""
        environ = os.environ if environ is None else environ
        names = {r.key_env for m in self.models for r in m.replicas if r.key_env is not None}
        return sorted(name for name in names if not environ.get(name, "").strip())

    def price_table(self, prices: Mapping[str, object] | None = None,
                    tier_multipliers: Mapping[str, float] | None = None) -> PriceTable:
        """Each model's `prices`, with serve's top-level `prices` table ({model: {input, ...}},
        by name or alias) for the models that set none. A name that is served by no model keeps
        its entry (as before the registry); a model priced in both places is refused.
        tier_multipliers price the tiers a model's price does not set (billing/pricing.py)."""
        model_to_price: dict[str, ModelPrice] = {m.name: m.price for m in self.models if m.price is not None}
        top_level = PriceTable.from_config(prices)
        model_to_key: dict[str, str] = {}
        for key in prices or {}:
            entry = self.get(key)
            if entry is not None and entry.price is not None:
                raise ValueError(f"prices.{key}: model {entry.name!r} is priced in its [[models]] entry already")
            name = entry.name if entry is not None else key
            if model_to_key.setdefault(name, key) != key:
                raise ValueError(f"prices.{key}: model {name!r} is priced already, as prices.{model_to_key[name]}")
            model_to_price[name] = top_level.price(key)
        return PriceTable(model_to_price, tier_multipliers)

    # ---- checks across models --------------------------------------------------------------------

    def _where(self, i: int) -> str:
        # The implicit models come last and cannot clash (from_config checks their names), so
        # an index is where a model sits in the config's [[models]].
        return f"models[{i}]"

    def _fallback_indexes(self, i: int, name_to_index: Mapping[str, int]) -> tuple[int, ...]:
        entry, indexes = self.models[i], []
        for j, name in enumerate(entry.fallbacks):
            where = f"{self._where(i)}.fallbacks[{j}]"
            k = name_to_index.get(name)
            if k is None:
                raise ValueError(f"{where}: no model is named {name!r}; known: {', '.join(sorted(name_to_index))}")
            if k == i:
                raise ValueError(f"{where}: {name!r} is this model; a model cannot fall back to itself")
            if self.models[k].kind != entry.kind:
                raise ValueError(f"{where}: {name!r} is {a(self.models[k].kind)} model; {a(entry.kind)} model "
                                 f"falls back only to {entry.kind} models")
            if k in indexes:
                raise ValueError(f"{where}: {name!r} is {self.models[k].name!r}, already a fallback of this model")
            indexes.append(k)
        return tuple(indexes)

    def _check_no_cycle(self, edges: Sequence[tuple[int, ...]]) -> None:
        """Depth first; a fallback met again while still on the path closes a cycle."""
        done: set[int] = set()

        def visit(i: int, path: list[int]) -> None:
            if i in path:
                cycle = " → ".join(self.models[k].name for k in [*path[path.index(i):], i])
                raise ValueError(f"{self._where(i)}.fallbacks: a cycle, {cycle}; a fallback must not lead back to "
                                 "a model already tried")
            if i in done:
                return
            for k in edges[i]:
                visit(k, [*path, i])
            done.add(i)

        for i in range(len(self.models)):
            visit(i, [])

    def _check_local_engines(self) -> None:
        kind_to_index: dict[str, int] = {}
        for i, entry in enumerate(self.models):
            replica = entry.local_replica
            if replica is None:
                continue
            other = kind_to_index.setdefault(entry.kind, i)
            if other != i:
                elsewhere = "tokenway workers" if entry.kind == "chat" else "an openai replica"
                raise ValueError(f"{self._where(i)}.replicas[{entry.replicas.index(replica)}]: a second {entry.kind} "
                                 f"model with a local replica ({self._where(other)} has one); this process runs one "
                                 f"{entry.kind} engine for now: serve the others from {elsewhere}")


def _breadth_first(i: int, edges: Sequence[tuple[int, ...]]) -> list[int]:
    order, seen = [i], {i}
    for k in order:  # grows as it goes: each model's fallbacks join the end
        for j in edges[k]:
            if j not in seen:
                seen.add(j)
                order.append(j)
    return order
