"""What the server's routes share, built once at start-up (cli.py) and never changed after:

    ServerConfig   the settings (--host, --max-pending-requests, the safety policies, ...)
    ModelCatalog   the served names (chat, embeddings), their aliases, each chat model's
                   frontend (its tokenizer and prompt checks) or, untemplated, its window
    Capacity       the engine requests in flight, against --max-pending-requests (mutable:
                   the one counter a request changes, owned here, held by Services)
    Services       the settings, the catalog and the collaborators: router, engine, embedder,
                   gatekeeper, observer, capacity, body parser, response store, background responses,
                   batch store, response cache

Stage functions (frontend/templating.py, safety/, gateway/admission.py) take typed inputs;
Services only wires them for the routes (server/prepare.py, the *_api.py routers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

from tokenway.batches import BatchStore
from tokenway.conversations import ResponseStore
from tokenway.embeddings import EmbeddingEngine
from tokenway.engine.client import EngineClient
from tokenway.frontend.model import ModelFrontend
from tokenway.gateway.auth import Principal
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.observability.observer import Observer
from tokenway.protocol.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from tokenway.routing.build import local_max_in_flight
from tokenway.routing.replicas import LocalReplica
from tokenway.routing.router import Pool, Router
from tokenway.safety.screen import SafetyPolicy
from tokenway.server.body_parser import BodyParser
from tokenway.server.response_cache import ResponseCache
from tokenway.server.responses_tasks import BackgroundResponses
from tokenway.server.stats import ServerStats


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    max_batch_file_bytes: int = 200 * 2**20  # a batch input file, or a message batch's body (OpenAI's cap)
    # Requests allowed in flight (running + queued) before new ones get 503 + Retry-After.
    max_pending_requests: int = 256
    graceful_shutdown_seconds: float = 30.0
    admin_key: str | None = None  # guards /admin; None disables the admin API
    tool_parser: str | None = None  # the local model's tool-call format (--tool-parser); None: its template's
    reasoning_parser: str | None = None  # the local model's thinking format (--reasoning-parser); None: its template's
    safety: SafetyPolicy = SafetyPolicy()  # the safety stage's checks (--safety-input, --safety-output)
    model_safety: Mapping[str, SafetyPolicy] = field(default_factory=dict)  # a model's own ([models.safety])


@dataclass(frozen=True, slots=True)
class ModelCatalog:
    """The models this server answers for. A chat model tokenway has no tokenizer for (an
    upstream's) has no frontend: its jobs go untemplated, with the messages, and the upstream
    templates and counts them; its window is the config's (context_windows)."""

    chat_model_names: tuple[str, ...]
    frontends: Mapping[str, ModelFrontend] = field(default_factory=dict)  # served name -> its frontend
    context_windows: Mapping[str, int] = field(default_factory=dict)  # served name -> window (untemplated)
    aliases: Mapping[str, str] = field(default_factory=dict)  # another name clients may use -> the served name
    embedding_model_names: tuple[str, ...] = ()

    @classmethod
    def local(cls, frontend: ModelFrontend, chat_model_names: tuple[str, ...],
              aliases: Mapping[str, str] | None = None, embedding_model_names: tuple[str, ...] = ()) -> ModelCatalog:
        """Every chat name served by the one local engine (its frontend)."""
        return cls(chat_model_names, dict.fromkeys(chat_model_names, frontend), {}, dict(aliases or {}),
                   embedding_model_names)

    def resolve(self, name: str | None, kind: str = "chat") -> str:
        """The served name a request's `model` refers to; 404 for anything else, 400 for a
        model of the other kind (chat / embeddings)."""
        name = self.aliases.get(name, name) if isinstance(name, str) else name
        names, others = self.chat_model_names, self.embedding_model_names
        if kind == "embeddings":
            names, others = others, names
        if name not in names:
            if name in others:
                other_kind = "a chat" if kind == "embeddings" else "an embeddings"
                raise InvalidRequestError(f"model: '{name}' is {other_kind} model; it cannot serve this endpoint",
                                          param="model", code="model_not_supported")
            raise NotFoundError.for_model(str(name))
        assert name is not None
        return name

    def frontend(self, name: str | None = None) -> ModelFrontend | None:
        """A served chat model's tokenizer and checks (None: the first served model's); None
        for a model tokenway has no tokenizer for."""
        return self.frontends.get(name if name is not None else self.chat_model_names[0])

    def max_model_len(self, name: str) -> int:
        frontend = self.frontends.get(name)
        return frontend.max_model_len if frontend is not None else self.context_windows[name]


class Capacity:
    """Engine requests (choices) of the calls in flight, against --max-pending-requests: past
    it a call is a 503 with Retry-After before its first byte. Batch lines count apart, against
    the same bound: the batch runner sizes them by the room the replicas leave (batch_lines.py),
    and lines queued deep in an engine must never turn an interactive call away. Only the event
    loop touches it."""

    def __init__(self, max_pending_requests: int) -> None:
        self.max_pending_requests = max_pending_requests
        self.num_in_flight = 0  # batch lines' included
        self.num_batch = 0

    def take(self, count: int = 1, batch: bool = False) -> None:
        num_taken = self.num_batch if batch else self.num_in_flight - self.num_batch
        if num_taken + count > self.max_pending_requests:
            raise ServiceUnavailableError(
                f"The server is at capacity ({num_taken} {'batch lines' if batch else 'requests'} in flight); "
                "retry shortly.", retry_after=1)
        self.num_in_flight += count
        self.num_batch += count if batch else 0

    def release(self, count: int = 1, batch: bool = False) -> None:
        self.num_in_flight -= count
        self.num_batch -= count if batch else 0


@dataclass(frozen=True, slots=True)
class Services:
    settings: ServerConfig
    catalog: ModelCatalog
    router: Router
    capacity: Capacity
    engine: EngineClient | None = None  # None: a gateway only (every model's replicas are remote)
    embedder: EmbeddingEngine | None = None  # /v1/embeddings; None: not served
    gatekeeper: Gatekeeper | None = None  # None: no auth, limits or ledger (benchmarks only)
    observer: Observer | None = None  # None: no traces, metrics or dashboard (--no-observability)
    body_parser: BodyParser = field(default_factory=BodyParser)
    created: int = field(default_factory=lambda: int(time.time()))
    response_store: ResponseStore | None = None  # /v1/responses' stored responses; None: none kept (tests)
    background: BackgroundResponses = field(default_factory=BackgroundResponses)  # background responses running
    batch_store: BatchStore | None = None  # the Files and Batch APIs' files, batches and lines; None: not served
    response_cache: ResponseCache | None = None  # whole responses kept for calls made again; None: none

    @classmethod
    def build(cls, settings: ServerConfig, catalog: ModelCatalog, router: Router, *,
              engine: EngineClient | None = None, embedder: EmbeddingEngine | None = None,
              gatekeeper: Gatekeeper | None = None,
              observer_for: Callable[[Callable[[], ServerStats]], Observer] | None = None,
              body_parser: BodyParser | None = None, response_store: ResponseStore | None = None,
              batch_store: BatchStore | None = None, response_cache: ResponseCache | None = None) -> Services:
        """The record, with its capacity and (given observer_for) the observer made from the
        /engine/stats reader they share."""
        capacity = Capacity(settings.max_pending_requests)
        stats = partial(_read_stats, engine, router, capacity)
        return cls(settings, catalog, router, capacity, engine, embedder, gatekeeper,
                   observer_for(stats) if observer_for is not None else None, body_parser or BodyParser(),
                   response_store=response_store, batch_store=batch_store, response_cache=response_cache)

    def resolve_model(self, name: str | None, principal: Principal | None = None, kind: str = "chat") -> str:
        """The catalog's served name for a request's `model` (404, 400), and 403 for one the
        caller's key may not use."""
        served = self.catalog.resolve(name, kind)
        if principal is not None and self.gatekeeper is not None:
            self.gatekeeper.check_model(principal, served)
        return served

    def safety_policy(self, model: str, principal: Principal | None = None) -> SafetyPolicy:
        """The caller's key's own policy where it has one, else the model's where its config
        sets one, else the server's."""
        if principal is not None and principal.safety is not None:
            return principal.safety
        return self.settings.model_safety.get(model, self.settings.safety)

    def tool_parser(self, frontend: ModelFrontend) -> str | None:
        """--tool-parser, for the local model; None: the model's template decides."""
        return self.settings.tool_parser if frontend.is_local else None

    def stats(self) -> ServerStats:
        return ServerStats.read(self.engine, self.router, self.capacity.num_in_flight)


def local_router(engine: EngineClient, chat_model_names: tuple[str, ...], max_pending_requests: int) -> Router:
    """Every served name as one pool: the local engine. Its probes (every 0.5 s) find a
    restarted engine back and close a breaker its failures opened."""
    replica = LocalReplica(engine)
    local = Pool.of("local", [replica], name_to_max_in_flight={replica.name: local_max_in_flight(max_pending_requests)})
    return Router(dict.fromkeys(chat_model_names, local))


def _read_stats(engine: EngineClient | None, router: Router, capacity: Capacity) -> ServerStats:
    return ServerStats.read(engine, router, capacity.num_in_flight)
