"""tokenway serve | generate | models.

    tokenway serve                                   # the default model on 127.0.0.1:8000
    tokenway serve --model ./my-model.gguf --port 9000 --kv-cache-memory 4GiB
    tokenway serve --config tokenway.toml            # same keys as the flags, e.g. port = 9000
    tokenway generate "The capital of France is" --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tomllib
from pathlib import Path

from tokenway.config import EngineConfig, parse_bytes
from tokenway.models.loader import DEFAULT_MODEL

# flag dest -> (type, default); the config file uses the same names (dashes or underscores).
SERVE_OPTIONS = {
    "model": (str, DEFAULT_MODEL),
    "served_model_name": (list, None),
    "host": (str, "127.0.0.1"),
    "port": (int, 8000),
    "max_model_len": (int, None),
    "kv_cache_memory": (str, "2GiB"),
    "dtype": (str, "auto"),
    "max_num_batched_tokens": (int, 512),
    "max_num_seqs": (int, 128),
    "enable_prefix_caching": (bool, True),
    "max_pending_requests": (int, 256),
    "max_body_bytes": (str, "8MiB"),
    "graceful_shutdown_seconds": (float, 30.0),
    "log_level": (str, "info"),
}


def load_config_file(path: str) -> dict:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"tokenway: config file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(f"tokenway: config file {path} is not valid TOML: {exc}") from None
    data = data.get("serve", data)
    options = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in SERVE_OPTIONS:
            raise SystemExit(f"tokenway: unknown key {key!r} in {path}; known: {', '.join(sorted(SERVE_OPTIONS))}")
        options[name] = [value] if name == "served_model_name" and isinstance(value, str) else value
    return options


def serve_options(args: argparse.Namespace) -> dict:
    """Defaults < config file < flags given on the command line."""
    options = {name: default for name, (_, default) in SERVE_OPTIONS.items()}
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
    serve.add_argument("--model", help=f"alias, .gguf file or HuggingFace directory (default {DEFAULT_MODEL})")
    serve.add_argument("--served-model-name", nargs="+", help="name(s) clients use for the model")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--kv-cache-memory", help="KV cache budget, e.g. 2GiB")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--max-num-batched-tokens", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False)
    serve.add_argument("--max-pending-requests", type=int, help="in flight before 503 + Retry-After")
    serve.add_argument("--max-body-bytes")
    serve.add_argument("--graceful-shutdown-seconds", type=float)
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def run_serve(options: dict) -> int:
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """SIGINT/SIGTERM: stop accepting, give in-flight requests the grace period, abort the
        rest, exit 0. (uvicorn would re-raise the signal after shutting down, exiting 130/143.)"""

        def handle_exit(self, sig: int, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: do not wait for the grace period
            self.should_exit = True

    from tokenway.engine.client import AsyncEngine
    from tokenway.gateway.app import create_app
    from tokenway.gateway.serving import ServerConfig, ServerState

    logging.basicConfig(level=options["log_level"].upper(), format="%(message)s", stream=sys.stderr)
    engine_config = EngineConfig(
        model=options["model"], max_model_len=options["max_model_len"],
        kv_cache_memory=options["kv_cache_memory"], dtype=options["dtype"],
        max_num_batched_tokens=options["max_num_batched_tokens"], max_num_seqs=options["max_num_seqs"],
        enable_prefix_caching=options["enable_prefix_caching"],
    )
    names = tuple(options["served_model_name"] or (Path(options["model"]).stem if options["model"] != DEFAULT_MODEL
                                                     else DEFAULT_MODEL,))
    server_config = ServerConfig(host=options["host"], port=options["port"], served_model_names=names,
                                 max_body_bytes=parse_bytes(options["max_body_bytes"], "max_body_bytes"),
                                 max_pending_requests=options["max_pending_requests"],
                                 graceful_shutdown_seconds=options["graceful_shutdown_seconds"])
    engine = AsyncEngine(engine_config)
    state = ServerState(engine=engine, config=server_config, model_names=names)
    app = create_app(state)
    server = Server(uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=server_config.graceful_shutdown_seconds, lifespan="off",
    ))

    async def main() -> None:
        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.05)
            print(f"tokenway: serving {', '.join(names)} on http://{server_config.host}:{server_config.port} "
                  f"(OpenAI /v1/chat/completions, /v1/completions; Anthropic /v1/messages)", file=sys.stderr,
                  flush=True)

        announcer = asyncio.create_task(announce())
        await server.serve()
        announcer.cancel()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    if not server.started:
        return 1  # could not bind, for instance
    print("tokenway: stopped", file=sys.stderr)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from tokenway import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
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
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(serve_options(args))
        return run_generate(args)
    except ValueError as exc:  # bad model path, bad size, ...: one clear line, no traceback
        print(f"tokenway: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
