"""`tokenway serve --workers N` with a local model: the host's one engine, behind the worker protocol.

    supervisor ─► HostEngine: `tokenway worker --host 127.0.0.1 --port P` (its engine in a child
                  process, restarted if it dies, as always), a fresh secret in its environment
    HTTP worker i ─► the config's local chat replica read as kind = "worker" at http://127.0.0.1:P
                  (route_to_host_engine), so each templates, tokenizes, admits and bills, and the
                  one engine batches every worker's requests together

N engines would load the weights N times and split the KV cache N ways; the worker protocol
(routing/wire.py) is the engine transport tokenway already has, so it is reused rather than a
third one made. Each HTTP worker fetches the tokenizer from it as any gateway does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
from typing import Any

SECRET_ENV = "TOKENWAY_HOST_ENGINE_SECRET"
READY_TIMEOUT_S = 1800.0  # a first start converts the model and compiles kernels
# serve's options that `tokenway worker` takes as they are (the same flag names)
WORKER_FLAGS = ("revision", "gguf_file", "max_model_len", "kv_cache_memory", "dtype", "quantization",
                "quant_activations", "linear_kernels", "max_num_batched_tokens", "max_num_seqs", "engine_niceness",
                "max_pending_requests", "graceful_shutdown_seconds", "log_level")
# serve's engine options the worker protocol does not carry: refused rather than silently dropped
NOT_CARRIED = ("speculative_method", "chat_template")


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_argv(options: dict[str, Any], model: str, name: str, port: int) -> list[str]:
    for option in NOT_CARRIED:
        if options[option] is not None:
            raise ValueError(f"{option}: not available with --workers N and a local model yet")
    argv = ["worker", "--model", model, "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]
    for option in WORKER_FLAGS:
        if options[option] is not None:
            argv += [f"--{option.replace('_', '-')}", str(options[option])]
    if not options["enable_prefix_caching"]:
        argv.append("--no-prefix-caching")
    return argv


def route_to_host_engine(registry: dict[str, Any], names: tuple[str, ...], url: str) -> dict[str, Any]:
    """The config's registry tables with the local chat replica made a worker replica at url;
    names: the served names of the default model, for a config without [[models]]."""
    worker = {"kind": "worker", "url": url, "secret_env": SECRET_ENV}
    if not registry.get("models"):
        return {**registry, "models": [{"name": names[0], "aliases": list(names[1:]), "replicas": [worker]}]}
    models = []
    for model in registry["models"]:
        if model.get("kind", "chat") == "chat":
            model = {**model, "replicas": [worker if replica.get("kind") == "local" else replica
                                           for replica in model.get("replicas", [])]}
        models.append(model)
    return {**registry, "models": models}


class HostEngine:
    """argv: `tokenway worker ...` (worker_argv). start() returns once it answers."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.argv, self.port = argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.secret = secrets.token_hex(32)
        self.process: asyncio.subprocess.Process | None = None
        self._watching: asyncio.Task | None = None
        self._stopping = False

    @property
    def env(self) -> dict[str, str]:
        """What the HTTP workers need to reach it."""
        return {SECRET_ENV: self.secret}

    async def start(self) -> bool:
        if not await self._start():
            return False
        self._watching = asyncio.ensure_future(self._watch())
        return True

    async def _watch(self) -> None:
        """A `tokenway worker` that exits on its own is started again: meanwhile the HTTP workers'
        health checks mark its replica down (503 with Retry-After), and up once it answers."""
        while self.process is not None:
            code = await self.process.wait()
            if self._stopping:
                return
            print(f"tokenway: the engine's worker exited with {code}; starting it again", file=sys.stderr, flush=True)
            await asyncio.sleep(1.0)
            if self._stopping:
                return
            await self._start()

    async def _start(self) -> bool:
        import httpx

        from tokenway.routing.wire import PREFIX

        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenway.cli", *self.argv,
            env={**os.environ, "TOKENWAY_WORKER_SECRET": self.secret})
        headers = {"authorization": f"Bearer {self.secret}"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2) as client:
            while self.process.returncode is None and loop.time() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}{PREFIX}/state", headers=headers)).status_code == 200:
                        return True
                await asyncio.sleep(0.2)
        return False

    async def stop(self, timeout_s: float) -> None:
        """After the HTTP workers: their calls drained first, then the engine's."""
        self._stopping = True
        if self._watching is not None:
            self._watching.cancel()
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
