"""What the stores on a SQL database (the ledger, billing/; the response store, conversations/;
the batch store, batches/) share about it: which failures are the database's outages, the
timeouts libpq needs, and DatabaseThreads, the queries on threads of their own with outages
refused at once."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

# Seconds; milliseconds.
_PG_TIMEOUTS: dict[str, Any] = {"connect_timeout": 5, "tcp_user_timeout": 15_000}


def is_transient(exc: BaseException) -> bool:
    """A failure of the connection or the server (down, restarting, a dropped connection, a
    lock held past the timeout), which a new connection or a later try may not have."""
    if isinstance(exc, (OSError, sqlite3.OperationalError)):
        return True
    psycopg = sys.modules.get("psycopg")  # looked up, not imported: SQLite-only servers never load it
    return psycopg is not None and isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def pg_timeouts(given: Mapping[str, Any]) -> dict[str, Any]:
    """libpq's timeouts, unless the connection string sets them (`given`: its conninfo_to_dict):
    without them a database host that vanished (no RST, as in a network partition) holds a
    connect(), a query or a COMMIT for minutes, where a store's outage handling wants a prompt
    error to retry after (or answer 503 with)."""
    return {name: value for name, value in _PG_TIMEOUTS.items() if name not in given}


class Closable(Protocol):
    def close(self) -> None: ...


B = TypeVar("B", bound=Closable)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Outage:
    since: float  # unix time of the failure that began it
    backoff_s: float
    retry_at: float  # time.monotonic(): before it, calls are refused without trying the database


class DatabaseThreads(Generic[B]):
    """A store's queries on threads of their own, each thread with its own connection (a
    backend, opened by the thread's first query), and the database's outages met once:

        event loop ── run(query) ──► outage? ── refuse at once: unavailable(retry_s) (503, Retry-After)
                                        │ no
                                        ▼
        a thread: the query; a transient failure: once more on a new connection, then an outage

    An outage (the database failed twice running) makes every call refuse at once until its
    retry time, retry_first_s doubling to retry_max_s, so a database host gone silent costs the
    first call a timeout rather than every call one; the first call after that time tries
    again, and its success ends the outage. The log gets one line as an outage starts and one as
    it ends. Every query must be safe to run twice (its first try's commit may have landed)."""

    def __init__(self, connect: Callable[[], B], num_connections: int, name: str, *, what: str,
                 unavailable: Callable[[float], Exception], retry_first_s: float, retry_max_s: float,
                 log: logging.Logger) -> None:
        """connect: opens one backend (a connection; the schema made if missing). name: the
        database for the log, without a password; what: the store, for the log ("batch store");
        log: the store's own logger."""
        self._log = log
        self._connect = connect
        self._name = name
        self._what = what
        self._unavailable = unavailable
        self._retry_first_s, self._retry_max_s = retry_first_s, retry_max_s
        self._executor = ThreadPoolExecutor(max_workers=num_connections, thread_name_prefix=what.replace(" ", "-"))
        self._local = threading.local()  # .backend: the executor thread's own connection
        self._backends: list[B] = []  # every one open, to close them all at the end
        self._backends_lock = threading.Lock()
        # Connections are opened one at a time: each makes the schema if missing (and SQLite's
        # switch to WAL), which concurrent openers on one new file would otherwise fight over.
        self._opening = threading.Lock()
        self._outage: Outage | None = None  # swapped whole; read on the event loop, written by the threads
        self.closed = False

    async def run(self, query: Callable[[B], T]) -> T:
        if self.closed:
            raise RuntimeError(f"the {self._what} is closed")
        outage = self._outage
        if outage is not None and (wait_s := outage.retry_at - time.monotonic()) > 0:
            raise self._unavailable(wait_s)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._query, query)

    async def close(self) -> None:
        """Finish the queries under way, then close every connection. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await asyncio.to_thread(self._executor.shutdown)
        with self._backends_lock:
            backends, self._backends = self._backends, []
        for backend in backends:
            close_quietly(backend)

    def _query(self, query: Callable[[B], T]) -> T:
        """On an executor thread."""
        error: Exception | None = None
        # A connection that fails gets one more try on a new one: the database may have dropped
        # it (a restart, an idle timeout). A new one that fails does not: the next would wait out
        # the same connect timeout.
        for _ in range(2):
            backend: B | None = getattr(self._local, "backend", None)
            reused = backend is not None
            try:
                if backend is None:
                    backend = self._local.backend = self._open()
                result = query(backend)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._drop(backend)
                error = exc
                if reused:
                    continue
                break
            if (outage := self._outage) is not None:
                self._outage = None
                self._log.info("%s: %s is reachable again, after %.0f s", self._what, self._name,
                            time.time() - outage.since)
            return result
        previous = self._outage
        backoff_s = self._retry_first_s if previous is None else min(2 * previous.backoff_s, self._retry_max_s)
        if previous is None:
            self._log.warning("%s: %s is unreachable (%r); calls are refused with 503 until it is back", self._what,
                           self._name, error)
        since = time.time() if previous is None else previous.since
        self._outage = Outage(since, backoff_s, time.monotonic() + backoff_s)
        raise self._unavailable(backoff_s) from error

    def _open(self) -> B:
        with self._opening:
            backend = self._connect()
        with self._backends_lock:
            self._backends.append(backend)
        return backend

    def _drop(self, backend: B | None) -> None:
        self._local.backend = None
        if backend is not None:
            with self._backends_lock:
                if backend in self._backends:
                    self._backends.remove(backend)
            close_quietly(backend)


def close_quietly(backend: Closable | None) -> None:
    if backend is not None:
        try:
            backend.close()
        except Exception:  # already failing, or closing at shutdown: the connection is dropped either way
            pass
