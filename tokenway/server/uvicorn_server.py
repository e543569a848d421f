"""The uvicorn server `tokenway serve` and `tokenway worker` both run.

SIGINT/SIGTERM: stop accepting, give in-flight requests the grace period, abort the rest, exit
0 (uvicorn itself would re-raise the signal after shutting down, exiting 130/143). The ready
line is printed once the socket is bound, before the first request can be answered, so a log
reader never races it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading

import uvicorn


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, announcement: str = "") -> None:
        super().__init__(config)
        self.announcement = announcement

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait for the grace period
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        # The handler stays for the rest of the process (uvicorn restores the default one when
        # serving ends): a second SIGTERM while the ledger, the spans and the engine process
        # are flushed and stopped must not kill the server half-way through them.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
        yield

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.announcement:
            print(self.announcement, file=sys.stderr, flush=True)


def run_event_loop(main) -> None:
    """Run a server's main coroutine on uvloop where it is installed (a faster event loop and
    socket layer: every request's I/O runs on it), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
