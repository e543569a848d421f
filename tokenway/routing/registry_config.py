"""One [[models]] entry of the config file, typed: a served model and the replicas that serve it.
registry.py holds the set of them (names, aliases, fallbacks); registry_toml.py reads one
entry from the parsed TOML, checking every key as it goes. Nothing here connects to anything.

    [[models]] table ──parse_model──► ModelEntry
        name, aliases, kind                          what clients call it; chat or embeddings
        [[models.replicas]] ──parse_replica──► ReplicaSpec (local | worker | openai | anthropic | responses)
        context_window, max_in_flight, *timeout_s    ─► context_window, BalancerConfig.max_in_flight, ModelTimeouts
        fallbacks, prices, balancer, breaker, health ─► fallbacks, ModelPrice, BalancerConfig, BreakerConfig,
                                                        HealthCheckConfig

A ValueError names the exact key ("models[2].replicas[0].url: must be http(s)://..."): each
layer raises with its own field first and its caller prefixes where that sits. Unknown keys
are refused, with the nearest known key suggested: a misspelt key must not silently leave a
default in place. Keys may be written with dashes, as serve's flags may.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from tokenway.billing.pricing import ModelPrice
from tokenway.routing.balancer import BalancerConfig
from tokenway.routing.health import BreakerConfig, HealthCheckConfig
from tokenway.safety.screen import SafetyPolicy

if TYPE_CHECKING:  # upstream.py imports the engine's types, and torch with them: not at config time
    from tokenway.routing.upstream import UpstreamTimeouts

ModelKind = Literal["chat", "embeddings"]
ReplicaKind = Literal["local", "worker", "openai", "anthropic", "responses"]
MODEL_KINDS: tuple[ModelKind, ...] = ("chat", "embeddings")
REPLICA_KINDS: tuple[ReplicaKind, ...] = ("local", "worker", "openai", "anthropic", "responses")
# Upstreams: another server templates and counts the model's calls; tokenway sends messages.
UPSTREAM_KINDS: tuple[ReplicaKind, ...] = ("openai", "anthropic", "responses")
# Upstreams whose own Batch API may take a batch whole (OpenAI's /files + /batches, Anthropic's
# /messages/batches): server/batch_forward.py.
BATCH_API_KINDS: tuple[ReplicaKind, ...] = ("openai", "anthropic")
# A worker speaks only generation (wire.py); Anthropic has no embeddings API.
MODEL_KIND_TO_REPLICA_KINDS: Mapping[ModelKind, tuple[ReplicaKind, ...]] = {
    "chat": REPLICA_KINDS, "embeddings": ("local", "openai")}
_URL_EXAMPLES = {"worker": "http://10.0.0.11:8100", "openai": "http://10.0.0.20:8000/v1",
                 "anthropic": "https://api.anthropic.com/v1", "responses": "https://api.openai.com/v1"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_NAME_CHARS = 256


def check_name(value: object, key: str) -> None:
    """A model name, alias or replica name: what clients send, traces and metrics label."""
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME_CHARS or not value.isprintable() \
            or any(c.isspace() for c in value):
        raise ValueError(f"{key}: must be 1 to {_MAX_NAME_CHARS} printable characters without spaces, "
                         f"got {value!r}")


def normalise_url(url: str) -> str:
    """http(s)://host[:port][/path], without the trailing slash. No credentials, query or
    fragment: a key belongs in an environment variable, not in a URL that logs and traces show
    (so a URL holding one is not echoed back either)."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ValueError("url: must not hold credentials; name the variable holding the key with "
                         "api_key_env (secret_env for a worker)")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise ValueError(f"url: bad port in {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment \
            or any(c.isspace() for c in url):
        raise ValueError(f"url: must be http(s)://host[:port][/path], got {url!r}")
    return url.rstrip("/")


def a(word: str) -> str:
    """'a worker', 'an openai': the article for a kind in a message."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def check_count(value: object, key: str, minimum: int = 1) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{key}: must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica of a pool, as configured.

    local      this process's engine. model: for a chat model, an alias, .gguf file or
               HuggingFace directory (from_config fills in serve's --model when the config names
               none); for embeddings, a sentence-transformers directory (None: the packaged
               all-MiniLM-L6-v2)
    worker     a `tokenway worker` at url (its root: tokenway adds /worker/v1); it serves the
               model it loaded. secret_env: the variable holding its shared secret
    openai     an OpenAI-compatible base URL, /v1 included (vLLM, SGLang, llama.cpp, a provider);
               model: the upstream's name for the model. api_key_env: the variable with its key
    anthropic  an Anthropic Messages base URL, /v1 included; model and api_key_env as openai
    batch_api  (openai, anthropic) the upstream's own Batch API takes a batch of this model's
               whole, instead of its lines one by one through the router (server/batch_forward.py)
    responses  a base URL that speaks OpenAI's Responses API (POST /responses), /v1 included: for
               models served only there (OpenAI's newest); model and api_key_env as openai
    """

    kind: ReplicaKind
    name: str = ""  # distinct within its pool (balancer, traces); "": "local", else the url's host[:port]
    url: str | None = None  # normalised: no trailing slash
    model: str | None = None
    secret_env: str | None = None
    api_key_env: str | None = None
    max_in_flight: int | None = None  # None: the model's
    batch_api: bool = False

    def __post_init__(self) -> None:
        if self.kind not in REPLICA_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(REPLICA_KINDS)}, got {self.kind!r}")
        if self.kind == "local":
            if self.url is not None:
                raise ValueError("url: a local replica has none (it is this process's engine)")
        elif self.url is None:
            raise ValueError(f"url: required for {a(self.kind)} replica, e.g. {_URL_EXAMPLES[self.kind]}")
        else:
            object.__setattr__(self, "url", normalise_url(self.url))
            if self.kind == "worker" and urlsplit(self.url).path:
                raise ValueError(f"url: a worker's root, e.g. {_URL_EXAMPLES['worker']} (tokenway adds /worker/v1), "
                                 f"got {self.url!r}")
        if not self.name:
            object.__setattr__(self, "name", "local" if self.url is None else urlsplit(self.url).netloc)
        check_name(self.name, "name")
        if self.secret_env is not None and self.kind != "worker":
            raise ValueError(f"secret_env: only a worker has one; {a(self.kind)} replica's key is api_key_env")
        if self.api_key_env is not None and self.kind not in UPSTREAM_KINDS:
            raise ValueError(f"api_key_env: {a(self.kind)} replica has none" +
                             ("; a worker's secret is secret_env" if self.kind == "worker" else ""))
        for key in ("secret_env", "api_key_env"):
            value = getattr(self, key)
            # Not echoed: a value that is no variable name may be the key itself, pasted here.
            if value is not None and (not isinstance(value, str) or not _ENV_NAME.fullmatch(value)):
                raise ValueError(f"{key}: must name an environment variable (letters, digits, _), "
                                 "not hold the key itself")
        if self.kind == "worker" and self.model is not None:
            raise ValueError("model: a worker serves the model it loaded (tokenway worker --model)")
        if self.kind in UPSTREAM_KINDS and self.model is None:
            raise ValueError(f"model: required for {a(self.kind)} replica (the upstream's name for the model)")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"model: must be a non-empty string, got {self.model!r}")
        if self.max_in_flight is not None:
            check_count(self.max_in_flight, "max_in_flight")
        if self.batch_api and self.kind not in BATCH_API_KINDS:
            raise ValueError(f"batch_api: {a(self.kind)} replica has no Batch API tokenway speaks; "
                             f"only {' and '.join(BATCH_API_KINDS)} replicas may take a batch whole")

    @property
    def key_env(self) -> str | None:
        """The variable holding this replica's key or secret, if it needs one."""
        return self.secret_env or self.api_key_env


@dataclass(frozen=True, slots=True)
class ModelTimeouts:
    """Seconds. Config keys: timeout_s, first_token_timeout_s, between_tokens_timeout_s,
    connect_timeout_s. Remote replicas' waits; the deadline bounds any call, local ones too."""

    deadline: float | None = None  # a call's whole budget when its request sets none; None: no deadline
    first_token: float = 120.0  # request sent -> first event: the upstream's queue and prefill
    between_tokens: float = 60.0  # the longest silence once events flow
    connect: float = 10.0

    def __post_init__(self) -> None:
        for key in ("deadline", "first_token", "between_tokens", "connect"):
            value = getattr(self, key)
            if value is not None and (type(value) not in (int, float) or not 0 < value < math.inf):
                raise ValueError(f"{key}: must be a number of seconds > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ResponseCacheConfig:
    """[models.cache]: the model's response cache (gateway/response_cache.py). A key's own
    setting (Principal.response_cache) turns it on or off for that key, whatever `enabled` says."""

    enabled: bool = False
    ttl_s: float = 3600.0  # an entry's life
    forced: bool = False  # every call is cached, not only greedy (temperature 0) or seeded ones
    shared: bool = False  # an entry serves every key, not only the key whose call made it

    def __post_init__(self) -> None:
        if type(self.ttl_s) not in (int, float) or not 0 < self.ttl_s < math.inf:
            raise ValueError(f"ttl_s: must be a number of seconds > 0, got {self.ttl_s!r}")


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A served model: its names, its pool of replicas and how calls to it are routed."""

    name: str
    replicas: tuple[ReplicaSpec, ...]
    kind: ModelKind = "chat"
    aliases: tuple[str, ...] = ()
    # Tokens, prompt + output. None: the engine's or worker's own (they report it); a model with
    # an openai or anthropic replica must say, as tokenway cannot ask them.
    context_window: int | None = None
    fallbacks: tuple[str, ...] = ()  # names or aliases, tried in order when this pool is down or full
    price: ModelPrice | None = None  # config key `prices`; None: priced by serve's top-level prices, if at all
    timeouts: ModelTimeouts = field(default_factory=ModelTimeouts)
    # Its max_in_flight is per replica, unless a replica sets its own.
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    health: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    safety: SafetyPolicy | None = None  # config [models.safety]; None: serve's --safety-* policy
    cache: ResponseCacheConfig | None = None  # config [models.cache]; None: the defaults (off)

    def __post_init__(self) -> None:
        for key in ("replicas", "aliases", "fallbacks"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        check_name(self.name, "name")
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}")
        for i, alias in enumerate(self.aliases):
            check_name(alias, f"aliases[{i}]")
            if alias == self.name or alias in self.aliases[:i]:
                raise ValueError(f"aliases[{i}]: {alias!r} is already a name of this model")
        for i, fallback in enumerate(self.fallbacks):
            check_name(fallback, f"fallbacks[{i}]")
        if not self.replicas:
            raise ValueError("replicas: at least one ([[models.replicas]])")
        allowed = MODEL_KIND_TO_REPLICA_KINDS[self.kind]
        for i, replica in enumerate(self.replicas):
            if replica.kind not in allowed:
                raise ValueError(f"replicas[{i}].kind: {a(replica.kind)} replica cannot serve {a(self.kind)} model; "
                                 f"use {' or '.join(allowed)}")
            if replica.name in (r.name for r in self.replicas[:i]):
                raise ValueError(f"replicas[{i}].name: {replica.name!r} is already another replica's; give each "
                                 "replica of a pool its own name")
            if replica.kind == "local" and any(r.kind == "local" for r in self.replicas[:i]):
                raise ValueError(f"replicas[{i}]: a second local replica; this process runs one engine, so it would "
                                 "be the same replica twice")
        if self.context_window is not None:
            check_count(self.context_window, "context_window")
        elif self.kind == "chat" and any(r.kind in UPSTREAM_KINDS for r in self.replicas):
            raise ValueError("context_window: required for a model with an openai, anthropic or responses replica "
                             "(tokenway cannot ask them; the window check and /v1/models need it)")

    @property
    def names(self) -> tuple[str, ...]:
        """The name, then the aliases."""
        return (self.name, *self.aliases)

    @property
    def local_replica(self) -> ReplicaSpec | None:
        return next((r for r in self.replicas if r.kind == "local"), None)

    @property
    def batch_replica(self) -> ReplicaSpec | None:
        """The replica a batch of this model's is handed whole: the first, in order, with batch_api."""
        return next((r for r in self.replicas if r.batch_api), None)

    @property
    def name_to_max_in_flight(self) -> dict[str, int]:
        """Balancer's argument of the same name: the replicas that override balancer.max_in_flight."""
        return {r.name: r.max_in_flight for r in self.replicas if r.max_in_flight is not None}

    def upstream_timeouts(self) -> UpstreamTimeouts:
        """For this pool's remote replicas (OpenAIUpstream, AnthropicUpstream, WorkerReplica)."""
        from tokenway.routing.upstream import UpstreamTimeouts

        t = self.timeouts
        return UpstreamTimeouts(connect=t.connect, first_event=t.first_token, between_events=t.between_tokens,
                                total=t.deadline, probe=self.health.timeout)
