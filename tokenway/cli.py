"""tokenway serve | worker | generate | chat | keys | usage | trace.

    tokenway serve                                   # the default model on 127.0.0.1:8000
    tokenway serve --model ./my-model.gguf --port 9000 --kv-cache-memory 4GiB
    tokenway serve --config tokenway.toml            # same keys as the flags, e.g. port = 9000
    tokenway worker --host 0.0.0.0 --port 8100       # one engine, served to gateways on other hosts
    tokenway generate "The capital of France is" --max-tokens 16
    tokenway chat --url http://127.0.0.1:8000        # an interactive chat with any OpenAI-compatible server
    tokenway keys create --name alice --rpm 60       # API keys: create | list | rotate | revoke
    tokenway usage --key-id k_...                    # the ledger by key, day, model and service tier
    tokenway trace chatcmpl-...                      # where one request's time went
    tokenway trace --summary                         # ... and over the last requests
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import tomllib
from functools import partial
from pathlib import Path
from typing import Any

# Light imports only: the body parser's worker process (spawned) imports this module again.
from tokenway.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL, EngineConfig, parse_bytes
from tokenway.models.hub import add_hub_arguments, default_model_name
from tokenway.routing.registry import REGISTRY_KEYS
from tokenway.serve_build import (
    admin_key,
    build_embedder,
    build_gatekeeper,
    build_observer,
    build_response_cache,
    check_tls,
    database_path,
    database_url,
    read_chat_template,
    safety_policy,
    store_flag,
)
from tokenway.server import connections

# flag dest -> (type, default); the config file uses the same names (dashes or underscores).
SERVE_OPTIONS = {
    "model": (str, DEFAULT_MODEL),
    "revision": (str, None),  # a Hub id's branch, tag or commit
    "gguf_file": (str, None),  # a Hub id's GGUF, as --model org/name:file.gguf
    "served_model_name": (list, None),
    "host": (str, "127.0.0.1"),
    "port": (int, 8000),
    "max_model_len": (int, None),
    "kv_cache_memory": (str, "2GiB"),
    "dtype": (str, "auto"),
    "linear_kernels": (str, "auto"),
    "quantization": (str, "auto"),
    "quant_activations": (str, "auto"),
    "max_num_batched_tokens": (int, 512),
    "max_num_seqs": (int, 128),
    "batch_slowdown": (str, "0.25"),  # what batch work may add to a step's time beside better classes; "none"
    "enable_prefix_caching": (bool, True),
    # speculative decoding (engine/spec_decode.py), as vLLM's speculative_config
    "speculative_method": (str, None),  # "ngram" (None: off)
    "num_speculative_tokens": (int, 0),
    "prompt_lookup_max": (int, 4),
    "prompt_lookup_min": (int, 2),
    "tool_parser": (str, None),  # the local model's tool-call format; default: the one its chat template has
    "reasoning_parser": (str, None),  # the local model's thinking format; default: the one its chat template has
    "chat_template": (str, None),  # a Jinja file rendering chats for the local model, instead of its own template
    # True: special-token strings inside messages are read as the control tokens (default: as text)
    "special_tokens_in_messages": (bool, False),
    # the safety stage (safety/screen.py): off | flag | redact | block, and which categories
    "safety_input": (str, "off"),
    "safety_output": (str, "off"),
    "safety_categories": (str, None),  # comma-separated; default: every built-in category
    "safety_guard_model": (str, None),  # a served model asked, in Llama Guard's format, about each input
    "safety_guard_format": (str, "prompt"),  # "prompt" | "chat_template" (a Llama Guard model's own)
    "safety_guard_fail_closed": (bool, False),
    "engine_process": (bool, True),  # the engine in a child process (False: a thread of the server)
    "engine_niceness": (int, 10),  # added to the engine process's niceness (> 0: the HTTP side wakes first)
    "embeddings": (bool, True),  # serve all-MiniLM-L6-v2 on /v1/embeddings beside the chat model
    "max_pending_requests": (int, 256),
    "max_body_bytes": (str, "8MiB"),
    "max_batch_file_bytes": (str, "200MiB"),  # a Batch API input file, or a message batch's body
    "graceful_shutdown_seconds": (float, 30.0),
    "workers": (int, 1),  # HTTP processes on the one port (server/workers.py)
    # reading requests (server/connections.py ConnectionPolicy; None: its default, caps from RLIMIT_NOFILE)
    "header_timeout_seconds": (float, None),
    "body_timeout_seconds": (float, None),
    "keep_alive_timeout_seconds": (float, None),
    "max_connections": (int, None),
    "max_connections_per_client": (int, None),
    "log_level": (str, "info"),
    # stage 1 and 7: keys, limits, ledger
    "db": (str, None),  # SQLite file for API keys and (by default) the ledger
    "ledger_url": (str, None),  # "sqlite:///path" or "postgresql://..."; default: the db file
    "limits_url": (str, "memory"),  # "memory" (one process) or "redis://host:port" (shared)
    # whole responses kept for calls made again ([models.cache], a key's response_cache)
    "response_cache_url": (str, "memory"),  # "memory" (this process) or "redis://host:port" (shared)
    "response_cache_bytes": (str, "256MiB"),  # the memory store's bound
    "store_url": (str, None),  # API keys: "postgresql://..." shared by every gateway; default: the db file
    "responses_ttl": (str, None),  # stored responses deleted this long after they were made (30d, 12h); None: kept
    "responses_lease_seconds": (float, 60.0),  # a background response outliving its server this long is failed
    "batch_lease_seconds": (float, 60.0),  # a batch line outliving its server this long runs again elsewhere
    "limits_on_error": (str, "open"),  # while that Redis is down: "open" admits without it, "closed" 503s
    # "auto": off only on loopback while no key has existed and no admin key is set; "on" | "off"
    "auth": (str, "auto"),
    "admin_key": (str, None),  # guards /admin; better from $TOKENWAY_ADMIN_KEY or admin_key_file
    "admin_key_file": (str, None),  # a file holding the admin key (first line)
    # TLS at the gateway: both files, PEM (the key unencrypted)
    "ssl_certfile": (str, None),
    "ssl_keyfile": (str, None),
    "gateway": (bool, True),  # False: no auth, limits or ledger (for measuring what they cost)
    "default_rpm": (int, None),
    "default_tpm": (int, None),
    "default_tpd": (int, None),
    "default_max_concurrent": (int, None),
    "default_max_tokens": (int, None),
    "max_messages": (int, 2048),
    "prices": (dict, None),  # {model: {input, cached_input, output}} in USD per million tokens
    "tier_price_multipliers": (dict, None),  # {priority, flex, batch: factor of a model's price}; None: 1, .5, .5
    "default_service_tiers": (list, None),  # the tiers a key that names none may use; None: default, flex, batch
    # of every key's limits and budget, what its batch lines may use (its other calls always have the rest)
    "batch_limit_share": (float, 0.5),
    # observability: traces, /metrics, /dashboard, OTLP export
    "observability": (bool, True),  # False: none of them (to measure what they cost)
    "trace_capacity": (int, 2048),  # traces kept in memory (older ones stay in the ledger)
    "otlp_endpoint": (str, None),  # OTLP/HTTP collector, e.g. http://127.0.0.1:4318; also $OTEL_EXPORTER_OTLP_ENDPOINT
    "otlp_headers": (dict, None),  # extra headers for the collector (config file only)
}


# The cyclic collector's thresholds while serving. A call allocates some thousand container
# objects and frees nearly all of them by reference counting, so at Python's default (700) the
# youngest generation was collected ~190 times a second under load, and after the start-up
# freeze every tenth collection of the middle one was a full one (the traces' ring and what else
# lives past a call: ~17 ms each, twice a second). With 10,000 the collector took 175 ms of 13 s
# at ~1,450 calls/s against 870 ms (bench/RESULTS.md), and a full collection comes every ~40 s.
GC_THRESHOLDS = (10_000, 10, 10)

def parse_slowdown(text: str | float | None) -> float | None:
    """--batch-slowdown: a fraction (0.25), a percentage (25%), or none."""
    if text is None or str(text).strip().lower() in ("none", "off"):
        return None
    value = str(text).strip()
    try:
        return float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise SystemExit(f"--batch-slowdown: expected a fraction such as 0.25, a percentage or none, got {text!r}")\
            from None


def load_config_file(path: str) -> dict:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"tokenway: config file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(f"tokenway: config file {path} is not valid TOML: {exc}") from None
    table = data.get("serve", data)
    # The model registry's own tables ([[models]], embeddings = false) go to routing/registry.py.
    options: dict[str, Any] = {"registry": {key: data[key] for key in REGISTRY_KEYS if key in data}}
    for key, value in table.items():
        name = key.replace("-", "_")
        if table is data and name in REGISTRY_KEYS:
            continue
        if name not in SERVE_OPTIONS:
            raise SystemExit(f"tokenway: unknown key {key!r} in {path}; known: {', '.join(sorted(SERVE_OPTIONS))}")
        options[name] = [value] if name == "served_model_name" and isinstance(value, str) else value
    return options


def serve_options(args: argparse.Namespace) -> dict:
    """Defaults < config file < flags given on the command line."""
    options = {name: default for name, (_, default) in SERVE_OPTIONS.items()}
    options["registry"] = {}
    if args.config:
        options.update(load_config_file(args.config))
    for name in SERVE_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    return options


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible HTTP server")
    serve.add_argument("--config", help="a TOML file with the same keys as these flags")
    serve.add_argument("--model", help=f"alias, .gguf file, HuggingFace directory or Hub id: org/name, "
                       f"org/name:file.gguf (default {DEFAULT_MODEL})")
    add_hub_arguments(serve)
    serve.add_argument("--served-model-name", nargs="+", help="name(s) clients use for the model")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--kv-cache-memory", help="KV cache budget, e.g. 2GiB")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--quantization", choices=["auto", "none"],
                       help="auto: compute on a GGUF's quantized blocks directly (CPU: Q4_0-Q8_0, Q4_K-Q6_K); "
                            "none: dequantize at load (default auto)")
    serve.add_argument("--quant-activations", choices=["auto", "int8", "dtype"],
                       help="what activations meet the GGUF blocks in: int8 (AVX512-VNNI, as llama.cpp) or the "
                            "model dtype; auto: int8 unless --dtype float32 (default auto)")
    serve.add_argument("--linear-kernels", choices=["auto", "default", "onednn"],
                       help="CPU matmul per weight: auto measures torch's default against oneDNN's packed layout")
    serve.add_argument("--tool-parser", choices=["generic", "hermes", "llama3_json", "mistral"],
                       help="the tool-call format of the model's replies (default: the one its chat template "
                            "renders tools in; generic for a template without tools)")
    serve.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"],
                       help="how the model's replies mark their thinking, sent apart as reasoning_content "
                            "(default: qwen3 where its chat template writes <think>; none otherwise)")
    serve.add_argument("--chat-template", help="a Jinja file that renders chats for the model instead of its own "
                                               "chat template (as vLLM's --chat-template)")
    serve.add_argument("--special-tokens-in-messages", dest="special_tokens_in_messages", action="store_const",
                       const=True, help="read special-token strings inside messages (<|im_start|>...) as the "
                                        "control tokens; by default they are text, so a caller cannot forge a turn")
    serve.add_argument("--safety-input", choices=["off", "flag", "redact", "block"],
                       help="secrets and PII in the prompt: name them in the trace (flag), redact them before "
                            "the model sees them, or refuse the call with a 400 (block); default off")
    serve.add_argument("--safety-output", choices=["off", "flag", "redact", "block"],
                       help="... in the reply: flag, redact, or end it there with finish_reason content_filter")
    serve.add_argument("--safety-categories", help="comma-separated, of api_key,credit_card,iban,email,phone "
                                                   "(default: all)")
    serve.add_argument("--safety-guard-model", help="a served model (any kind of replica) asked whether each "
                                                    "input is unsafe, in Llama Guard 3's format and categories")
    serve.add_argument("--safety-guard-format", choices=["prompt", "chat_template"],
                       help="prompt: the guard task as a user turn (any model); chat_template: the conversation "
                            "as it is, for a Llama Guard model whose template builds the task")
    serve.add_argument("--safety-guard-fail-closed", dest="safety_guard_fail_closed", action="store_const",
                       const=True, help="a guard that cannot answer refuses the call (503) instead of passing it")
    serve.add_argument("--max-num-batched-tokens", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--batch-slowdown", help="how much longer an engine step may take for the batch work in it "
                                                "while interactive requests run (0.25: 25%%); none: no bound")
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False)
    serve.add_argument("--speculative-method", choices=["ngram"],
                       help="speculative decoding: ngram drafts tokens from the request's own context (prompt "
                            "lookup) and verifies them in one forward; outputs that copy their prompt gain most")
    serve.add_argument("--num-speculative-tokens", type=int, help="tokens drafted per step (e.g. 4)")
    serve.add_argument("--prompt-lookup-max", type=int, help="longest n-gram looked up for drafts (default 4)")
    serve.add_argument("--prompt-lookup-min", type=int, help="shortest n-gram looked up for drafts (default 2)")
    serve.add_argument("--engine-process", dest="engine_process", action="store_const", const=True,
                       help="step the engine in its own child process, restarted if it dies (the default)")
    serve.add_argument("--engine-thread", dest="engine_process", action="store_const", const=False,
                       help="step the engine in a thread of the server process instead")
    serve.add_argument("--engine-niceness", type=int,
                       help="added to the engine process's niceness, so the HTTP side wakes first (default 10: "
                            "an interactive call beside a batch reaches its first token as fast as alone; 0 "
                            "shares the cores evenly)")
    serve.add_argument("--no-embeddings", dest="embeddings", action="store_const", const=False,
                       help="do not serve /v1/embeddings (all-minilm-l6-v2)")
    serve.add_argument("--max-pending-requests", type=int, help="in flight before 503 + Retry-After")
    serve.add_argument("--max-body-bytes")
    serve.add_argument("--max-batch-file-bytes", help="the largest Batch API input file or message batch "
                       "(default 200MiB)")
    serve.add_argument("--graceful-shutdown-seconds", type=float)
    connections.add_arguments(serve)
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--db", help="SQLite file for API keys and the usage ledger (default: the keys CLI's)")
    serve.add_argument("--ledger-url", help="sqlite:///path or postgresql://... for the usage ledger")
    serve.add_argument("--limits-url", help="'memory' (default) or redis://host:port to share limits and budgets")
    serve.add_argument("--response-cache-url", help="where the response cache ([models.cache]) keeps responses: "
                       "'memory' (default) or redis://host:port, shared by every gateway on it")
    serve.add_argument("--response-cache-bytes", help="the in-memory response cache's bound (default 256MiB)")
    serve.add_argument("--store-url", help="postgresql://... to keep API keys (limits, budgets, policies) in one "
                       "database every gateway shares (default: the --db SQLite file)")
    serve.add_argument("--batch-limit-share", type=float,
                       help="the fraction of each key's RPM, TPM, TPD, concurrency and budget its batch lines may "
                            "use; its other calls always find the rest (default 0.5; 1: no share)")
    serve.add_argument("--responses-ttl", help="delete stored responses (/v1/responses) this long after they were "
                       "made, e.g. 30d, 12h, 3600 (default: kept until deleted)")
    serve.add_argument("--batch-lease-seconds", type=float,
                       help="a batch line whose server stopped renewing its claim this long (killed, say) is run "
                            "again by any server on the database (default 60)")
    serve.add_argument("--limits-on-error", choices=["open", "closed"],
                       help="while the --limits-url Redis is down: open admits calls without its limits (budgets "
                            "by the ledger's spend), closed refuses them with 503 limits_unavailable (default open)")
    serve.add_argument("--auth", choices=["auto", "on", "off"],
                       help="whether calls need an API key: auto (default) is off only on a loopback bind while "
                            "no key has ever existed and no admin key is set, and on for good after; on or off "
                            "whatever the key store holds")
    serve.add_argument("--admin-key", help="guards /admin; visible to every user in `ps`: prefer "
                       "$TOKENWAY_ADMIN_KEY or --admin-key-file (none of them: admin API off)")
    serve.add_argument("--admin-key-file", help="a file whose first line is the admin key")
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this PEM certificate (chain)")
    serve.add_argument("--ssl-keyfile", help="... and this PEM private key")
    serve.add_argument("--workers", type=int, help="HTTP processes serving the one port, under a supervisor that "
                       "owns the limits (without a Redis) and reloads the config on SIGHUP (default 1)")
    serve.add_argument("--no-gateway", dest="gateway", action="store_const", const=False,
                       help="no auth, limits or ledger (to measure what they cost)")
    for name in ("rpm", "tpm", "tpd", "max-concurrent", "max-tokens"):
        serve.add_argument(f"--default-{name}", type=int, help=f"{name} for keys that set none")
    serve.add_argument("--no-observability", dest="observability", action="store_const", const=False,
                       help="no traces, /metrics, dashboard or OTLP export (to measure what they cost)")
    serve.add_argument("--trace-capacity", type=int, help="traces kept in memory (default 2048)")
    serve.add_argument("--otlp-endpoint", help="export spans over OTLP/HTTP, e.g. http://127.0.0.1:4318 "
                       "(default $OTEL_EXPORTER_OTLP_ENDPOINT; unset: off)")


def run_serve(options: dict, argv: list[str] | None = None) -> int:
    """argv: the command line, which each of --workers N processes is started with."""
    from tokenway.server.workers import WorkerSlot

    slot = WorkerSlot.from_env()
    if options["workers"] != 1 and slot is None:
        return supervise(options, sys.argv[1:] if argv is None else argv)
    if slot is not None:
        slot.follow_supervisor()
    if slot is not None and slot.engine_url is not None:  # the local model is the supervisor's engine
        from tokenway.server.host_engine import route_to_host_engine

        names = tuple(options["served_model_name"] or (default_model_name(options["model"]),))
        options = {**options, "registry": route_to_host_engine(options["registry"], names, slot.engine_url),
                   "served_model_name": None}
    registry = None
    if options["registry"].get("models"):  # pools of replicas from the config file (routing/build.py)
        from tokenway.routing.registry import Registry

        registry = Registry.from_config(options["registry"], default_model=options["model"],
                                        served_model_names=options["served_model_name"])
    # The engine process starts now, before this one imports torch and the app: the two import
    # side by side, and it loads the model once told which (ProcessEngine).
    engine_child = None
    if options["engine_process"] and (registry is None or registry.local_model("chat") is not None):
        from tokenway.engine.child import EngineChild

        engine_child = EngineChild.start(options["engine_niceness"])
    import socket
    import uuid

    import uvicorn

    from tokenway.batches import open_batch_store
    from tokenway.batches.runner import DEFAULT_MAX_RUNNING, BatchRunner
    from tokenway.conversations import open_response_store, parse_duration
    from tokenway.engine.client import AsyncEngine
    from tokenway.engine.process import ProcessEngine
    from tokenway.frontend.reasoning_parsers import check_reasoning_parser
    from tokenway.frontend.tool_parsers import FORMATS
    from tokenway.gateway.auth import AuthPolicy, is_loopback
    from tokenway.routing.batch_room import LOCAL_QUEUE_DEPTH
    from tokenway.server.app import create_app
    from tokenway.server.batch_forward import build_forwarder
    from tokenway.server.batch_lines import LineExecutor, batch_capacity, principal_of
    from tokenway.server.responses_background import bill_abandoned
    from tokenway.server.services import ModelCatalog, ServerConfig, Services, local_router
    from tokenway.server.uvicorn_server import Server, run_event_loop
    from tokenway.server.workers import read_peers_metrics, worker_sockets

    logging.basicConfig(level=options["log_level"].upper(), format="%(message)s", stream=sys.stderr)
    engine_config = EngineConfig(
        model=options["model"], revision=options["revision"], gguf_file=options["gguf_file"],
        max_model_len=options["max_model_len"],
        kv_cache_memory=options["kv_cache_memory"], dtype=options["dtype"],
        linear_kernels=options["linear_kernels"],
        quantization=options["quantization"], quant_activations=options["quant_activations"],
        max_num_batched_tokens=options["max_num_batched_tokens"], max_num_seqs=options["max_num_seqs"],
        batch_slowdown=parse_slowdown(options["batch_slowdown"]),
        enable_prefix_caching=options["enable_prefix_caching"],
        speculative_method=options["speculative_method"], num_speculative_tokens=options["num_speculative_tokens"],
        prompt_lookup_max=options["prompt_lookup_max"], prompt_lookup_min=options["prompt_lookup_min"],
    )
    names = tuple(options["served_model_name"] or (default_model_name(options["model"]),))
    aliases = {}
    if registry is not None:
        local = registry.local_model("chat")
        local_replica = local.local_replica if local is not None else None
        if local_replica is not None:
            engine_config.model = local_replica.model or options["model"]
        names = tuple(e.name for e in registry.models if e.kind == "chat")
        aliases = {alias: e.name for e in registry.models if e.kind == "chat" for alias in e.aliases}
        for missing in registry.env_keys_missing():
            print(f"tokenway: WARNING: ${missing} is not set; the replicas that need it will be refused",
                  file=sys.stderr, flush=True)
    server_config = ServerConfig(host=options["host"], port=options["port"], served_model_names=names,
                                 max_body_bytes=parse_bytes(options["max_body_bytes"], "max_body_bytes"),
                                 max_batch_file_bytes=parse_bytes(options["max_batch_file_bytes"],
                                                                  "max_batch_file_bytes"),
                                 max_pending_requests=options["max_pending_requests"],
                                 graceful_shutdown_seconds=options["graceful_shutdown_seconds"],
                                 admin_key=admin_key(options), tool_parser=options["tool_parser"],
                                 reasoning_parser=options["reasoning_parser"],
                                 safety=safety_policy(options),
                                 model_safety={e.name: e.safety for e in registry.models if e.safety is not None}
                                 if registry is not None else {})
    check_tls(options)
    # A bad value is one line now, not after loading.
    connection_policy = connections.ConnectionPolicy.from_options(options)
    AuthPolicy(options["auth"], options["host"])
    responses_ttl_s = parse_duration(options["responses_ttl"], "responses_ttl") if options["responses_ttl"] else None
    if not options["responses_lease_seconds"] > 0:
        raise ValueError(f"responses_lease_seconds: must be > 0, got {options['responses_lease_seconds']!r}")
    if not options["batch_lease_seconds"] > 0:
        raise ValueError(f"batch_lease_seconds: must be > 0, got {options['batch_lease_seconds']!r}")
    for policy in (server_config.safety, *server_config.model_safety.values()):
        if policy.guard_model is not None and policy.guard_model not in names and policy.guard_model not in aliases:
            raise ValueError(f"safety guard_model: {policy.guard_model!r} is not a served chat model "
                             f"({', '.join(names)})")
    if options["tool_parser"] not in (None, *FORMATS):
        raise ValueError(f"tool_parser: expected one of {', '.join(FORMATS)}, got {options['tool_parser']!r}")
    if options["reasoning_parser"] is not None:
        check_reasoning_parser(options["reasoning_parser"])
    chat_template = read_chat_template(options["chat_template"])
    engine = None
    if registry is None or registry.local_model("chat") is not None:  # else a gateway only: no model here
        # The engine process loads while the rest is built: waited for below, before serving.
        engine = (ProcessEngine(engine_config, options["engine_niceness"], engine_child, wait=False)
                  if options["engine_process"] else AsyncEngine(engine_config))
    gatekeeper = build_gatekeeper(options, registry, slot) if options["gateway"] else None
    serve_embeddings = options["embeddings"] and (registry is None or registry.local_model("embeddings") is not None)
    embedder = build_embedder() if serve_embeddings else None
    embedding_model_names = (DEFAULT_EMBEDDING_MODEL,) if embedder else ()
    response_cache = build_response_cache(options, registry)
    observer_for = partial(build_observer, gatekeeper=gatekeeper, options=options) if options["observability"] else None
    # Stored responses (/v1/responses) live with the ledger; with no gateway, in memory.
    response_store = open_response_store(database_url(options) if options["gateway"] else "memory")
    # So are the Batch APIs' files, batches and lines: every gateway on one database shares the queue.
    batch_store = open_batch_store(database_url(options) if options["gateway"] else "memory")
    scheme = "https" if options["ssl_certfile"] else "http"
    if isinstance(engine, ProcessEngine):
        engine.wait_started()

    async def main() -> bool:
        """Build the routes, then the services and the app once, and serve until stopped;
        whether the server started (it may not bind its port)."""
        if registry is not None:
            from tokenway.routing.build import build_router

            routes = await build_router(
                registry, engine, max_pending_requests=server_config.max_pending_requests,
                cache_dir=Path(engine_config.cache_dir or os.environ.get("TOKENWAY_CACHE_DIR")
                               or Path.home() / ".cache" / "tokenway") / "tokenizers")
            router = routes.router
            catalog = ModelCatalog(names, routes.frontends, routes.context_windows, aliases, embedding_model_names)
        else:
            assert engine is not None, "without a registry the local engine serves every name"
            router = local_router(engine, names, server_config.max_pending_requests)
            catalog = ModelCatalog.local(engine.frontend, names, aliases, embedding_model_names)
            # A conversation comes back longer on every turn (a chat's messages, a response's stored
            # chain): its earlier turns' ids are kept, as routing/build.py keeps them for a pool.
            engine.frontend.tokenizer.enable_segment_cache()
        if chat_template is not None:
            if engine is None:
                raise ValueError("chat_template: there is no local model to render chats for (every model's "
                                 "replicas are remote)")
            engine.frontend.tokenizer.use_chat_template(chat_template, options["chat_template"])
        if options["special_tokens_in_messages"]:
            for frontend in catalog.frontends.values():
                frontend.tokenizer.special_tokens_in_messages = True
        services = Services.build(server_config, catalog, router, engine=engine, embedder=embedder,
                                  gatekeeper=gatekeeper, observer_for=observer_for, response_store=response_store,
                                  batch_store=batch_store, response_cache=response_cache)
        app = create_app(services)
        # A batch's lines run through the app itself (batch_lines.py) on the room interactive calls leave.
        # A batch of a model whose upstream has its own Batch API goes there whole (batch_forward.py).
        forwarder = build_forwarder(registry, router, batch_store, gatekeeper)
        batch_runner = BatchRunner(batch_store, LineExecutor(app, principal_of(gatekeeper)),
                                   f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                                   batch_capacity(services.capacity, router, engine_config.max_num_seqs),
                                   options["batch_lease_seconds"],
                                   # as many lines as the engine runs and queues: capacity is the bound
                                   max_running=max(DEFAULT_MAX_RUNNING, LOCAL_QUEUE_DEPTH * engine_config.max_num_seqs),
                                   forward=forwarder)
        if services.observer is not None:
            services.observer.watch_batches(batch_runner.stats.to_dict)
        server = Server(uvicorn.Config(
            app, host=server_config.host, port=server_config.port, log_level="warning",
            access_log=False, lifespan="off",
            # uvicorn's annotation says int; it waits with asyncio, which takes any seconds.
            timeout_graceful_shutdown=server_config.graceful_shutdown_seconds,  # pyright: ignore[reportArgumentType]
            ssl_certfile=options["ssl_certfile"], ssl_keyfile=options["ssl_keyfile"],
        ), policy=connection_policy)
        server.announcement = (f"tokenway: serving {', '.join(names + embedding_model_names)} on "
                               f"{scheme}://{server_config.host}:{server_config.port} (OpenAI /v1/chat/completions, "
                               f"/v1/completions{', /v1/embeddings' if embedder else ''}; Anthropic /v1/messages)")
        await services.body_parser.start()
        router.start()
        services.background.start(response_store, lease_s=options["responses_lease_seconds"], ttl_s=responses_ttl_s,
                                  bill=partial(bill_abandoned, services))
        batch_runner.start()
        if gatekeeper is not None:
            print(f"tokenway: auth {gatekeeper.auth_summary}; limits {options['limits_url']}; ledger "
                  f"{gatekeeper.ledger.url}", file=sys.stderr, flush=True)
            if gatekeeper.auth_required and gatekeeper.keys.count_active() == 0:
                # With an admin key, no key yet is how a deployment starts (keys come from
                # POST /admin/keys): said, not warned.
                warning = "" if gatekeeper.auth.has_admin_key else "WARNING: "
                print(f"tokenway: {warning}auth is on and no live API key exists, so every /v1 call is refused "
                      f"with 401 until one is created:\n    tokenway keys create --name NAME "
                      f"{store_flag(gatekeeper.keys)}  (or POST /admin/keys)", file=sys.stderr, flush=True)
            elif not gatekeeper.auth_required and options["auth"] == "off" and not is_loopback(server_config.host):
                print(f"tokenway: WARNING: --auth off and {server_config.host} is reachable from other machines: "
                      "anyone who reaches it calls the models", file=sys.stderr, flush=True)
        # What start-up made (the app, tokenizers, registries) lives as long as the server: out of
        # the collector's sight, so a collection walks only what requests make (fewer, shorter pauses).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        if slot is None:
            await server.serve()
        else:  # one of --workers N: the supervisor's listening socket, and a socket of its own for /metrics
            server.announcement = f"tokenway: worker {slot.index} (pid {os.getpid()}) ready"
            server.on_started = slot.mark_ready
            if services.observer is not None:
                services.observer.metrics.worker_label = str(slot.index)
                services.observer.metrics.peers = partial(read_peers_metrics, slot, scheme == "https")
            try:
                await server.serve(sockets=worker_sockets(slot))
            finally:
                slot.metrics_path.unlink(missing_ok=True)
        # The lines running finish within the grace (their rows and outcomes written), else are left
        # to their lease: the next runner on this database runs them again.
        await batch_runner.stop(server_config.graceful_shutdown_seconds)
        if forwarder is not None:
            await forwarder.aclose()
        await services.background.aclose()  # each background response stored as ended, billed, traced
        await router.aclose()
        await services.body_parser.close()
        if gatekeeper is not None:
            await gatekeeper.close()  # flush the ledger
        await response_store.close()
        await batch_store.close()
        await response_cache.close()
        if services.observer is not None:
            await asyncio.to_thread(services.observer.close)  # flush spans (bounded: 5 s)
        return server.started

    try:
        started = run_event_loop(main())
    finally:
        if engine is not None:
            engine.shutdown()
        if embedder is not None:
            embedder.shutdown()
    if not started:
        return 1  # could not bind, for instance
    print("tokenway: stopped", file=sys.stderr)
    return 0


def supervise(options: dict, argv: list[str]) -> int:
    """--workers N: the supervisor (server/workers.py). Without a Redis it owns every key's limits and
    budgets, seeded from the ledger as one gateway's are; the workers ask it (gateway/counters.py)."""
    from tokenway.gateway.limits import limits_backend
    from tokenway.routing.registry import Registry
    from tokenway.server.workers import Supervisor

    if options["workers"] < 1:
        raise ValueError(f"workers: must be >= 1, got {options['workers']}")
    local = Registry.from_config(options["registry"], default_model=options["model"],
                                 served_model_names=options["served_model_name"]).local_model("chat")
    engine = None
    if local is not None:  # one engine for the host, behind the worker protocol (server/host_engine.py)
        from tokenway.server.host_engine import HostEngine, free_loopback_port, worker_argv

        replica, port = local.local_replica, free_loopback_port()
        assert replica is not None, "local_model() is the model with a local replica"
        engine = HostEngine(worker_argv(options, replica.model or options["model"], local.name, port), port)
    logging.basicConfig(level=options["log_level"].upper(), format="%(message)s", stream=sys.stderr)
    counters = None
    if options["gateway"] and limits_backend(options["limits_url"]) == "memory":
        from tokenway.billing.ledger import Ledger
        from tokenway.gateway.budgets import InProcessBudgets
        from tokenway.gateway.counters import CounterServer
        from tokenway.gateway.limits import InProcessLimiter
        from tokenway.gateway.shares import batch_spend_seed

        database_path(options).parent.mkdir(parents=True, exist_ok=True)
        ledger = Ledger(database_url(options))  # read for the budgets' seeds only: the workers write it
        counters = CounterServer(InProcessLimiter(), InProcessBudgets(ledger.spend_usd,
                                                                      share_seed=batch_spend_seed(ledger)),
                                 also_close=ledger.close)
    return Supervisor(argv, options["workers"], options["host"], options["port"], counters=counters, engine=engine,
                      graceful_shutdown_seconds=options["graceful_shutdown_seconds"]).run()


def run_usage(args: argparse.Namespace) -> int:
    """`tokenway usage`: the ledger by key, day, model and service tier; requests served apart from those
    refused."""
    from tokenway.billing.ledger import USAGE_FIELDS, Ledger
    from tokenway.keys_cli import default_db_path

    db = Path(args.db) if args.db else default_db_path()
    ledger = Ledger(args.ledger_url or f"sqlite:///{db.resolve()}")

    async def read() -> list[dict]:
        try:
            return await ledger.usage(args.key_id)
        finally:
            await ledger.close()

    rows = asyncio.run(read())
    print("  ".join(f"{c:>16}" for c in USAGE_FIELDS))
    for row in rows:
        print("  ".join(f"{row[c]:>16.6f}" if c == "cost_usd" else f"{row[c]!s:>16}" for c in USAGE_FIELDS))
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from tokenway import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, revision=args.revision, gguf_file=args.gguf_file)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate([args.prompt], params)[0]
    print(output.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    generate = sub.add_parser("generate", help="generate once, offline")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=DEFAULT_MODEL)
    add_hub_arguments(generate)
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--dtype", default="auto")
    from tokenway.batches_cli import add_batches_parser, run_batches
    from tokenway.chat_cli import add_chat_parser, run_chat
    from tokenway.keys_cli import add_keys_parser, run_keys
    from tokenway.trace_cli import add_trace_parser, run_trace
    from tokenway.worker_cli import add_worker_parser, run_worker

    add_keys_parser(sub)
    add_batches_parser(sub)
    add_chat_parser(sub)
    add_trace_parser(sub)
    add_worker_parser(sub)
    usage = sub.add_parser("usage", help="usage by key, day, model and service tier, from the ledger")
    usage.add_argument("--key-id")
    usage.add_argument("--db")
    usage.add_argument("--ledger-url")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            if args.admin_key:
                print("tokenway: WARNING: --admin-key is visible to every user of this machine (ps, /proc); "
                      "use $TOKENWAY_ADMIN_KEY or --admin-key-file", file=sys.stderr, flush=True)
            return run_serve(serve_options(args), argv)
        if args.command == "keys":
            return run_keys(args)
        if args.command == "batches":
            return run_batches(args)
        if args.command == "usage":
            return run_usage(args)
        if args.command == "trace":
            return run_trace(args)
        if args.command == "chat":
            return run_chat(args)
        if args.command == "worker":
            return run_worker(args)
        return run_generate(args)
    except ValueError as exc:  # bad model path, bad size, ...: one clear line, no traceback
        print(f"tokenway: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
