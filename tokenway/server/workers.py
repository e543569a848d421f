"""`tokenway serve --workers N`: N HTTP processes on one port, under one supervisor.

    supervisor (Supervisor.run: binds the port once, starts and replaces workers, serves no request)
     ├── counters: every key's limits and budgets (gateway/counters.py CounterServer) on
     │             <run dir>/counters.sock, unless --limits-url names a Redis the workers share
     ├── worker 0 .. N-1: each the same `tokenway serve` command line, told its WorkerSlot in
     │             $TOKENWAY_WORKER_SLOT: the app on the listening socket the supervisor bound
     │             (inherited; the kernel hands each new connection to one worker that accepts) and
     │             on <run dir>/worker-<serial>.sock of its own, through which the others read its
     │             /metrics
     └── engine: with a local model, `tokenway worker` on loopback (host_engine.py): the host's one
                   engine, which every worker routes to as a worker replica

One listening socket, bound before any worker starts and never closed while the supervisor
runs: a worker that stops closes only its own copy, so no connection waiting to be accepted is
lost to it (SO_REUSEPORT would give each worker its own queue, dropped when that worker goes).

SIGHUP: a new generation of N workers starts (reading the config file anew, as any start does);
once all are ready the old ones get SIGTERM and drain as a stopped server does (in-flight
calls finish within --graceful-shutdown-seconds). A new generation that fails to start is
stopped and the old one keeps serving. SIGINT/SIGTERM: every worker drains; exit 0 when all
did. A worker that dies on its own is started again (after 1 s, so a crash loop does not spin).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenway.server.uvicorn_server import run_event_loop

if TYPE_CHECKING:
    from tokenway.gateway.counters import CounterServer
    from tokenway.server.host_engine import HostEngine

logger = logging.getLogger(__name__)

SLOT_ENV = "TOKENWAY_WORKER_SLOT"
READY_TIMEOUT_S = 600.0  # a worker's start: the app, tokenizers, the ledger's journal
RESTART_DELAY_S = 1.0
LISTEN_BACKLOG = 4096


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """What one HTTP worker is told by its supervisor."""

    index: int  # 0 .. N-1: its place; a replacement takes the same index
    serial: int  # unique among the supervisor's workers: names its files
    listen_fd: int  # the port's listening socket, inherited
    ready_fd: int  # written once, when the worker serves
    run_dir: str  # the supervisor's private folder (mode 0700): its unix sockets
    counters: bool  # the supervisor owns the limits and budgets (no Redis): ask it
    engine_url: str | None = None  # the host's engine (host_engine.py), for the local model's replica

    @property
    def counters_path(self) -> Path:
        return Path(self.run_dir) / "counters.sock"

    @property
    def metrics_path(self) -> Path:
        return Path(self.run_dir) / f"worker-{self.serial}.sock"

    def journal_name(self, port: int) -> str:
        # Its own ledger journal (billing/journal.py holds one per process): a replacement
        # starting while the one it replaces drains must not find the file locked, and the
        # journal a worker left is adopted by whichever starts next.
        return f"{port}-w{self.index}-{self.serial}"

    @classmethod
    def from_env(cls) -> WorkerSlot | None:
        text = os.environ.get(SLOT_ENV)
        return cls(**json.loads(text)) if text else None

    def follow_supervisor(self) -> None:
        """Linux: this worker gets SIGTERM (and drains) if its supervisor dies, even by SIGKILL."""
        if sys.platform != "linux":
            return
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() == 1:  # it died before prctl took hold
            os.kill(os.getpid(), signal.SIGTERM)

    def mark_ready(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)


def bind_listener(host: str, port: int) -> socket.socket:
    """The port's one listening socket, inherited by every worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def worker_sockets(slot: WorkerSlot) -> list[socket.socket]:
    """The sockets a worker serves its app on: the port's (inherited) and its own unix socket."""
    listener = socket.socket(fileno=slot.listen_fd)
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(str(slot.metrics_path))
    own.listen(64)
    return [listener, own]


async def read_peers_metrics(slot: WorkerSlot, tls: bool) -> list[tuple[str, bytes]]:
    """The other workers' own /metrics, each as (its worker label, exposition); a worker that
    does not answer (stopping, just died) is left out of this scrape."""
    import httpx

    async def read(path: Path) -> tuple[str, bytes] | None:
        transport = httpx.AsyncHTTPTransport(uds=str(path), verify=False)  # noqa: S501 - our own socket
        try:
            async with httpx.AsyncClient(transport=transport, base_url=f"{'https' if tls else 'http'}://worker",
                                         timeout=5) as client:
                response = await client.get("/metrics", params={"scope": "process"})
                response.raise_for_status()
                return response.headers.get("x-tokenway-worker", path.stem), response.content
        except httpx.HTTPError as exc:
            logger.debug("metrics: %s did not answer: %r", path, exc)
            return None

    paths = [p for p in Path(slot.run_dir).glob("worker-*.sock") if p != slot.metrics_path]
    return [peer for peer in await asyncio.gather(*(read(p) for p in paths)) if peer is not None]


@dataclass(slots=True, eq=False)  # one per process: told apart by identity
class _Worker:
    slot: WorkerSlot
    ready: asyncio.Future[bool]  # True once it serves; False if it exited first
    process: asyncio.subprocess.Process | None = None  # None while being started
    running: asyncio.Task | None = None  # starts it, waits for its exit, replaces it if it died
    stopping: bool = False


class Supervisor:
    """argv: the `tokenway serve ...` arguments each worker is started with. counters: the
    owner of the limits and budgets (None: the workers share a Redis, or there is no gateway).
    engine: the host's engine for a local model, started before the first worker and stopped
    after the last."""

    def __init__(self, argv: list[str], num_workers: int, host: str, port: int, *,
                 counters: CounterServer | None = None, engine: HostEngine | None = None,
                 graceful_shutdown_seconds: float = 30.0) -> None:
        if num_workers < 1:
            raise ValueError(f"workers: must be >= 1, got {num_workers}")
        self.argv, self.num_workers, self.host, self.port = argv, num_workers, host, port
        self.counters, self.engine, self.graceful_s = counters, engine, graceful_shutdown_seconds
        self._serial = 0
        self._current: list[_Worker] = []
        self._draining: set[_Worker] = set()
        self._stopping = False
        self._reloading: asyncio.Task | None = None
        self._env: dict[str, str] = {}

    def run(self) -> int:
        try:
            listener = bind_listener(self.host, self.port)
        except OSError as exc:
            print(f"tokenway: cannot bind {self.host}:{self.port}: {exc.strerror}", file=sys.stderr, flush=True)
            return 1
        run_dir = tempfile.mkdtemp(prefix="tokenway-workers-")  # 0700: only this user reaches its sockets
        try:
            # uvloop where installed: each admission a worker asks the counters is a round trip here
            return run_event_loop(self._main(listener, run_dir))
        finally:
            listener.close()
            shutil.rmtree(run_dir, ignore_errors=True)

    async def _main(self, listener: socket.socket, run_dir: str) -> int:
        self.listener, self.run_dir = listener, run_dir
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: done.done() or done.set_result(None))
        loop.add_signal_handler(signal.SIGHUP, lambda: None)  # until the first workers serve: nothing to reload
        if self.counters is not None:
            await self.counters.start(Path(run_dir) / "counters.sock")
        try:
            if self.engine is not None:
                if not await self.engine.start():
                    print("tokenway: the engine did not start; stopping", file=sys.stderr, flush=True)
                    return 1
                self._env = self.engine.env
            self._current = [self._spawn(index) for index in range(self.num_workers)]
            if not await self._all_ready(self._current):
                print("tokenway: a worker did not start; stopping", file=sys.stderr, flush=True)
                await self._stop(self._current)
                return 1
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            print(f"tokenway: {self.num_workers} workers serving on {self.host}:{self.port} "
                  f"(supervisor pid {os.getpid()}; SIGHUP reloads)", file=sys.stderr, flush=True)
            await done
            self._stopping = True
            if self._reloading is not None:
                await self._reloading
            codes = await self._stop([*self._current, *self._draining])
            return 0 if all(code == 0 for code in codes) else 1
        finally:
            if self.counters is not None:
                await self.counters.close()
            if self.engine is not None:
                await self.engine.stop(self.graceful_s + 30)

    def _spawn(self, index: int) -> _Worker:
        read_fd, write_fd = os.pipe()
        slot = WorkerSlot(index, self._serial, self.listener.fileno(), write_fd, self.run_dir,
                          self.counters is not None, self.engine.url if self.engine is not None else None)
        self._serial += 1
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()
        worker = _Worker(slot, ready)

        def on_ready() -> None:
            loop.remove_reader(read_fd)
            signalled = bool(os.read(read_fd, 1))
            os.close(read_fd)
            if not ready.done():
                ready.set_result(signalled)

        loop.add_reader(read_fd, on_ready)
        env = {**os.environ, **self._env, SLOT_ENV: json.dumps(asdict(slot))}
        create = asyncio.create_subprocess_exec(sys.executable, "-m", "tokenway.cli", *self.argv, env=env,
                                                pass_fds=(self.listener.fileno(), write_fd))
        worker.running = asyncio.ensure_future(self._run_worker(worker, create, write_fd))
        return worker

    async def _run_worker(self, worker: _Worker, create: Awaitable[asyncio.subprocess.Process],
                          write_fd: int) -> None:
        try:
            worker.process = await create
        finally:
            os.close(write_fd)  # the worker holds it now: its exit closes the pipe (ready: False)
        code = await worker.process.wait()
        if not worker.ready.done():
            worker.ready.set_result(False)
        if worker.stopping or self._stopping:
            return
        # Died on its own while serving: a replacement takes its place.
        logger.error("tokenway: worker %d (pid %d) exited with %d; starting another", worker.slot.index,
                     worker.process.pid, code)
        await asyncio.sleep(RESTART_DELAY_S)
        if self._stopping or worker not in self._current:
            return
        replacement = self._spawn(worker.slot.index)
        self._current[self._current.index(worker)] = replacement

    async def _all_ready(self, workers: list[_Worker]) -> bool:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                return all(await asyncio.gather(*(w.ready for w in workers)))
        except TimeoutError:
            return False

    async def _stop(self, workers: list[_Worker]) -> list[int]:
        """SIGTERM each (it drains within the grace), SIGKILL one that outlives it by far; exit codes."""
        for worker in workers:
            worker.stopping = True
        while any(w.process is None and w.running is not None and not w.running.done() for w in workers):
            await asyncio.sleep(0.01)  # being exec'd: a signal needs its pid
        for worker in workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)

        async def wait(worker: _Worker) -> int:
            if worker.process is None:
                return 1
            try:
                async with asyncio.timeout(self.graceful_s + 30):
                    return await worker.process.wait()
            except TimeoutError:
                worker.process.kill()
                return await worker.process.wait()

        return list(await asyncio.gather(*(wait(w) for w in workers)))

    def _on_sighup(self) -> None:
        if self._stopping:
            return
        if self._reloading is not None and not self._reloading.done():
            print("tokenway: a reload is under way; SIGHUP ignored", file=sys.stderr, flush=True)
            return
        self._reloading = asyncio.ensure_future(self._reload())

    async def _reload(self) -> None:
        print("tokenway: SIGHUP: starting a new generation of workers", file=sys.stderr, flush=True)
        new = [self._spawn(index) for index in range(self.num_workers)]
        if not await self._all_ready(new) or self._stopping:
            print("tokenway: the new workers did not start; the running ones keep serving", file=sys.stderr,
                  flush=True)
            await self._stop(new)
            return
        old, self._current = self._current, new
        self._draining.update(old)
        print(f"tokenway: reloaded; {len(old)} old workers draining", file=sys.stderr, flush=True)
        await self._stop(old)
        self._draining.difference_update(old)
