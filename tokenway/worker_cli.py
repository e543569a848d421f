"""`tokenway worker`: one engine, served to gateways on other hosts (routing/wire.py's protocol).

    tokenway worker --host 0.0.0.0 --port 8100 --secret-file /etc/tokenway/worker.secret
    TOKENWAY_WORKER_SECRET=... tokenway worker --model ./my-model.gguf --kv-cache-memory 4GiB

The engine steps in a child process (engine/process.py: restarted if it dies). The secret
comes from --secret-file (its first line), else $TOKENWAY_WORKER_SECRET; a worker that binds
anything but loopback refuses to start without one, since whoever reaches it could run the
model. SIGINT / SIGTERM: stop accepting, give open streams the grace period, exit 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from tokenway.config import DEFAULT_MODEL, EngineConfig

# Light imports only, as cli.py's: `tokenway keys` must not wait for torch.
from tokenway.models.hub import add_hub_arguments, default_model_name
from tokenway.server import connections

SECRET_ENV = "TOKENWAY_WORKER_SECRET"
MIN_SECRET_CHARS = 16


def add_worker_parser(sub) -> None:
    worker = sub.add_parser("worker", help="serve one engine to tokenway gateways on other hosts")
    worker.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"alias, .gguf file, HuggingFace directory or Hub id: org/name, org/name:file.gguf "
                             f"(default {DEFAULT_MODEL})")
    add_hub_arguments(worker)
    worker.add_argument("--served-model-name", help="the name the worker reports for its model")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=8100)
    worker.add_argument("--secret-file", help=f"a file whose first line is the shared secret (else ${SECRET_ENV})")
    worker.add_argument("--max-model-len", type=int)
    worker.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget, e.g. 2GiB")
    worker.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    worker.add_argument("--quantization", default="auto", choices=["auto", "none"])
    worker.add_argument("--quant-activations", default="auto", choices=["auto", "int8", "dtype"])
    worker.add_argument("--linear-kernels", default="auto", choices=["auto", "default", "onednn"])
    worker.add_argument("--max-num-batched-tokens", type=int, default=512)
    worker.add_argument("--max-num-seqs", type=int, default=128)
    worker.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    worker.add_argument("--engine-niceness", type=int, default=10,
                        help="added to the engine process's niceness, so the HTTP side wakes first")
    worker.add_argument("--max-pending-requests", type=int, default=256, help="in flight before 503 + Retry-After")
    worker.add_argument("--graceful-shutdown-seconds", type=float, default=30.0)
    connections.add_arguments(worker)  # the same read timeouts and connection caps as `tokenway serve`
    worker.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def worker_secret(secret_file: str | None) -> str | None:
    """--secret-file's first line, else $TOKENWAY_WORKER_SECRET; None when neither is set."""
    if secret_file:
        try:
            lines = Path(secret_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"secret_file: cannot read {secret_file}: {exc.strerror}") from None
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ValueError(f"secret_file: {secret_file} is empty")
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        if not secret:
            return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"secret: at least {MIN_SECRET_CHARS} characters, e.g. from `openssl rand -hex 32`")
    return secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def run_worker(args: argparse.Namespace) -> int:
    # The secret is checked before the model loads, so a refusal costs no time.
    secret = worker_secret(args.secret_file)
    if secret is None and not is_loopback(args.host):
        raise ValueError(f"worker: --host {args.host} is reachable from other machines; give the shared secret "
                         f"with --secret-file or ${SECRET_ENV} (or bind 127.0.0.1)")
    # The engine process starts now: it imports torch and the engine while this one imports the
    # rest, and loads the model once ProcessEngine tells it which (as `tokenway serve` does).
    from tokenway.engine.child import EngineChild

    child = EngineChild.start(args.engine_niceness)
    import uvicorn

    from tokenway.engine.process import ProcessEngine
    from tokenway.models.loader import resolve_model
    from tokenway.routing.wire import PREFIX
    from tokenway.server.uvicorn_server import Server, run_event_loop
    from tokenway.server.worker_api import create_worker_app

    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    config = EngineConfig(
        model=args.model, revision=args.revision, gguf_file=args.gguf_file, max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
        linear_kernels=args.linear_kernels, quantization=args.quantization, quant_activations=args.quant_activations,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    policy = connections.ConnectionPolicy.from_options(vars(args))  # checked before the model loads
    if args.max_pending_requests < 1:
        raise ValueError(f"max_pending_requests: must be >= 1, got {args.max_pending_requests}")
    name = args.served_model_name or default_model_name(args.model)
    # Fetched and converted once, here; the engine finds it done.
    model_dir = resolve_model(config.model, config.cache_dir, revision=config.revision, gguf_file=config.gguf_file)
    engine = ProcessEngine(config, args.engine_niceness, child)
    try:
        app = create_worker_app(engine, name, secret, model_dir=model_dir, block_size=config.block_size,
                                max_pending_requests=args.max_pending_requests)
        server = Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=args.graceful_shutdown_seconds), policy=policy)
        auth = "secret required" if secret else "auth OFF (loopback, no secret)"
        server.announcement = (f"tokenway: worker serving {name} on http://{args.host}:{args.port}{PREFIX} "
                               f"({auth}; engine pid {engine.pid})")
        run_event_loop(server.serve())
    finally:
        engine.shutdown()
    if not server.started:
        return 1  # could not bind, for instance
    print("tokenway: worker stopped", file=sys.stderr)
    return 0
