"""Reading one [[models]] entry from the parsed TOML into registry_config.py's types: Table's
typed getters name each key's path in their errors, and refuse every key nobody asked for."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, cast, overload

from tokenway.billing.pricing import PRICED_TIERS, ModelPrice
from tokenway.routing.balancer import POLICIES, BalancerConfig
from tokenway.routing.health import BreakerConfig, HealthCheckConfig
from tokenway.routing.registry_config import (
    MODEL_KINDS,
    REPLICA_KINDS,
    ModelEntry,
    ModelKind,
    ModelTimeouts,
    ReplicaKind,
    ReplicaSpec,
    ResponseCacheConfig,
    a,
    check_count,
)
from tokenway.safety.guard import GUARD_FORMATS
from tokenway.safety.screen import MODES, SafetyPolicy


@contextmanager
def at(path: str) -> Iterator[None]:
    """A ValueError raised inside starts with its field ("url: ..."); say where that field sits."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"{path}.{exc}") from None


class Table:
    """One TOML table being read: typed getters whose errors name the key's path, and finish()
    refusing every key no getter asked for."""

    def __init__(self, path: str, data: object) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: must be a table, got {type(data).__name__} {data!r}")  # noqa: TRY004
        self.path = path
        self._data: dict[str, Any] = {}
        for key, value in data.items():
            name = key.replace("-", "_")
            if name in self._data:
                raise ValueError(f"{path}: {key!r} is given twice (with - and with _)")
            self._data[name] = value
        self._known: list[str] = []

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def _get(self, key: str, required: bool) -> Any:
        self._known.append(key)
        value = self._data.get(key)
        if value is None and required:
            raise ValueError(f"{self.at(key)}: required")
        return value

    @overload
    def text(self, key: str, *, required: Literal[True]) -> str: ...

    @overload
    def text(self, key: str, *, required: bool = False) -> str | None: ...

    def text(self, key: str, *, required: bool = False) -> str | None:
        value = self._get(key, required)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{self.at(key)}: must be a non-empty string, got {value!r}")
        return value

    @overload
    def choice(self, key: str, choices: tuple[str, ...], *, required: Literal[True]) -> str: ...

    @overload
    def choice(self, key: str, choices: tuple[str, ...], *, required: bool = False) -> str | None: ...

    def choice(self, key: str, choices: tuple[str, ...], *, required: bool = False) -> str | None:
        value = self._get(key, required)
        if value is not None and value not in choices:
            raise ValueError(f"{self.at(key)}: must be one of {', '.join(choices)}, got {value!r}")
        return value

    def flag(self, key: str) -> bool | None:
        value = self._get(key, False)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{self.at(key)}: must be true or false, got {value!r}")
        return value

    def texts(self, key: str) -> tuple[str, ...]:
        value = self._get(key, False)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.at(key)}: must be a list of strings, got {value!r}")
        return tuple(value)

    def count(self, key: str, *, minimum: int = 1) -> int | None:
        value = self._get(key, False)
        if value is not None:
            check_count(value, self.at(key), minimum)
        return value

    def number(self, key: str, *, minimum: float, maximum: float = math.inf, exclusive: bool = False,
               unit: str = "") -> float | None:
        """A finite int or float in [minimum, maximum] ((minimum, maximum] when exclusive)."""
        value = self._get(key, False)
        if value is None:
            return None
        is_number = type(value) in (int, float) and math.isfinite(value)  # TOML has inf and nan; bool is no number
        if not is_number or (value <= minimum if exclusive else value < minimum) or value > maximum:
            bound = f"{'>' if exclusive else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum < math.inf else "")
            raise ValueError(f"{self.at(key)}: must be a number{unit} {bound}, got {value!r}")
        return float(value)

    def seconds(self, key: str, *, allow_zero: bool = False) -> float | None:
        return self.number(key, minimum=0, exclusive=not allow_zero, unit=" of seconds")

    def table(self, key: str) -> Table | None:
        value = self._get(key, False)
        return None if value is None else Table(self.at(key), value)

    def tables(self, key: str) -> list[Table]:
        """An array of tables ([[path.key]])."""
        value = self._get(key, True)
        if not isinstance(value, list):
            raise ValueError(f"{self.at(key)}: must be an array of tables ([[...{key}]]), got {value!r}")  # noqa: TRY004
        return [Table(f"{self.at(key)}[{i}]", item) for i, item in enumerate(value)]

    def finish(self, context: str = "", key_to_hint: Mapping[str, str] | None = None) -> None:
        for key in self._data:
            if key not in self._known:
                close = difflib.get_close_matches(key, self._known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                hint = (key_to_hint or {}).get(key, hint)
                raise ValueError(f"{self.path}: unknown key {key!r}{context}{hint}; known: "
                                 f"{', '.join(sorted(set(self._known)))}")


def parse_replica(table: Table, model_name: str, model_kind: ModelKind, default_local_model: str) -> ReplicaSpec:
    kind = cast("ReplicaKind", table.choice("kind", REPLICA_KINDS, required=True))  # one of them: checked
    fields: dict[str, Any] = {"name": table.text("name") or "", "max_in_flight": table.count("max_in_flight")}
    if kind == "local":
        model = table.text("model")
        fields["model"] = default_local_model if model is None and model_kind == "chat" else model
    else:
        fields["url"] = table.text("url", required=True)
        if kind == "worker":
            fields["secret_env"] = table.text("secret_env")
        else:
            fields["model"] = table.text("model") or model_name
            fields["api_key_env"] = table.text("api_key_env")
            fields["batch_api"] = bool(table.flag("batch_api"))
    table.finish(f" for {a(kind)} replica")
    with at(table.path):
        return ReplicaSpec(kind, **fields)


def parse_model(table: Table, default_local_model: str) -> ModelEntry:
    """One [[models]] table; default_local_model: what a local chat replica loads when it names none."""
    name = table.text("name", required=True)
    kind = cast("ModelKind", table.choice("kind", MODEL_KINDS) or "chat")  # one of them: checked
    fields: dict[str, Any] = {
        "aliases": table.texts("aliases"), "context_window": table.count("context_window"),
        "fallbacks": table.texts("fallbacks"), "price": _price(table.table("prices")),
        "timeouts": ModelTimeouts(**_present({
            "deadline": table.seconds("timeout_s"), "first_token": table.seconds("first_token_timeout_s"),
            "between_tokens": table.seconds("between_tokens_timeout_s"),
            "connect": table.seconds("connect_timeout_s")})),
    }
    max_in_flight = table.count("max_in_flight")
    fields["balancer"] = _balancer(table.table("balancer"), max_in_flight)
    fields["breaker"] = _breaker(table.table("breaker"))
    fields["health"] = _health(table.table("health"))
    fields["safety"] = _safety(table.table("safety"))
    fields["cache"] = _cache(table.table("cache"))
    replicas = tuple(parse_replica(t, name, kind, default_local_model) for t in table.tables("replicas"))
    table.finish()
    with at(table.path):
        return ModelEntry(name, replicas, kind, **fields)


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The keys the config gave: the rest keep the dataclass's defaults."""
    return {key: value for key, value in fields.items() if value is not None}


def _price(table: Table | None, tiers: bool = True) -> ModelPrice | None:
    """A model's price, and the tiers priced apart as tables of their own ([models.prices.flex])."""
    if table is None:
        return None
    fields: dict[str, Any] = _present({key: table.number(key, minimum=0, unit=" (USD per million tokens)")
                                       for key in ("input", "cached_input", "output", "cached_response")})
    if tiers:
        fields["tiers"] = {tier: price for tier in PRICED_TIERS
                           if (price := _price(table.table(tier), tiers=False)) is not None}
    table.finish()
    return ModelPrice(**fields)


def _balancer(table: Table | None, max_in_flight: int | None) -> BalancerConfig:
    fields: dict[str, Any] = {"max_in_flight": max_in_flight}  # the model's key: one place, not two
    if table is not None:
        fields |= {
            "policy": table.choice("policy", POLICIES),
            "block_size": table.count("block_size"),
            "min_match_fraction": table.number("min_match_fraction", minimum=0, maximum=1),
            "balance_factor": table.number("balance_factor", minimum=1),
            "balance_slack_tokens": table.count("balance_slack_tokens", minimum=0),
            "max_num_indexed_blocks": table.count("max_num_indexed_blocks"),
            "max_queue": table.count("max_queue", minimum=0),
            "queue_timeout": table.seconds("queue_timeout_s", allow_zero=True),
            "retry_after": table.seconds("retry_after_s"),
        }
        table.finish(key_to_hint={"max_in_flight": " (it is the model's own key, max_in_flight)"})
    return BalancerConfig(**_present(fields))


def _breaker(table: Table | None) -> BreakerConfig:
    if table is None:
        return BreakerConfig()
    config = BreakerConfig(**_present({
        "failure_threshold": table.count("failure_threshold"), "failure_window": table.seconds("failure_window_s"),
        "cooldown": table.seconds("cooldown_s")}))
    table.finish()
    return config


def _health(table: Table | None) -> HealthCheckConfig:
    if table is None:
        return HealthCheckConfig()
    config = HealthCheckConfig(**_present({"interval": table.seconds("interval_s"),
                                           "timeout": table.seconds("timeout_s")}))
    table.finish()
    return config


def _safety(table: Table | None) -> SafetyPolicy | None:
    """[models.safety]: the model's own safety policy, in place of serve's --safety-* flags."""
    if table is None:
        return None
    categories = table.texts("categories")
    fail_closed = table.choice("guard_on_error", ("pass", "refuse"))
    policy = SafetyPolicy(**_present({"input": table.choice("input", MODES), "output": table.choice("output", MODES),
                                      "categories": frozenset(categories) if categories else None,
                                      "threshold": table.number("threshold", minimum=0, maximum=1),
                                      "guard_model": table.text("guard_model"),
                                      "guard_format": table.choice("guard_format", GUARD_FORMATS),
                                      "guard_fail_closed": None if fail_closed is None else fail_closed == "refuse"}))
    table.finish()
    return policy


def _cache(table: Table | None) -> ResponseCacheConfig | None:
    """[models.cache]: the model's response cache (enabled, ttl_s, forced, shared)."""
    if table is None:
        return None
    fields: dict[str, Any] = {"ttl_s": table.seconds("ttl_s")}
    for key in ("enabled", "forced", "shared"):
        value = fields[key] = table._get(key, False)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{table.at(key)}: must be true or false, got {value!r}")
    config = ResponseCacheConfig(**_present(fields))
    table.finish()
    return config
