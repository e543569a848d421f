"""The engine process's handle, light to import (no torch): `tokenway serve` starts the engine
process before it imports torch and its app itself, so the two processes import side by side;
the engine is told what to load once the model is resolved (ProcessEngine, engine/process.py).

    EngineChild.start() ── spawn ──► _main: imports the engine (torch, the kernels) ... waits
    EngineChild.load(config) ──────► ("load", config): EngineCore(config) ─► ("ready", snapshot)
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenway.config import EngineConfig
    from tokenway.engine.stats import EngineStats


class EngineChild:
    """One engine process and its two pipes; commands are sent by a writer thread, so a large
    prompt never blocks the event loop on a full pipe while the engine is mid-step."""

    def __init__(self, process, commands: Connection, results: Connection) -> None:
        self.process, self.commands, self.results = process, commands, results
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write, name="tokenway-engine-writer", daemon=True).start()

    @classmethod
    def start(cls, niceness: int = 0) -> EngineChild:
        """The process, importing the engine; load() tells it what to load."""
        context = multiprocessing.get_context("spawn")  # never fork a process holding torch's thread pools
        commands_read, commands_write = context.Pipe(duplex=False)
        results_read, results_write = context.Pipe(duplex=False)
        process = context.Process(target=_main, args=(niceness, commands_read, results_write),
                                  name="tokenway-engine", daemon=True)
        process.start()
        commands_read.close()  # the child's ends: this process keeps only its own
        results_write.close()
        return cls(process, commands_write, results_read)

    def load(self, config: EngineConfig) -> None:
        self.send(("load", config))

    def wait_ready(self) -> EngineStats | BaseException:
        """The engine's first snapshot, or why it could not start."""
        try:
            message = self.results.recv()
        except (EOFError, OSError):
            from tokenway.engine.client import EngineDeadError

            self.process.join(1.0)
            return EngineDeadError(f"the engine process exited while loading (code {self.process.exitcode})")
        if message[0] == "ready":
            return message[1]
        _, text, is_value_error = message
        return ValueError(text) if is_value_error else RuntimeError(text)

    def send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.commands.send(message)
            except (OSError, ValueError):  # the engine is gone: the reader restarts it
                return

    def stop(self, timeout: float) -> int | None:
        """Ask the engine to exit, then make sure it has; its exit code."""
        self._outbox.put(("stop",))
        self._outbox.put(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        return self.process.exitcode


def _main(niceness: int, commands: Connection, results: Connection) -> None:
    from tokenway.engine.process import engine_main

    engine_main(niceness, commands, results)
