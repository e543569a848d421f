"""The usage ledger: exactly one durable row per request, written by group commit.

    request path ── record(UsageRecord) ──► [journal] ──► queue ──► writer thread (writer.py): up
    to batch_max rows (or max_delay_s) per transaction, INSERT ... ON CONFLICT (request_id) DO
    NOTHING, COMMIT ◄── record() returns once the row is journaled, or without a journal committed

The writer owns its own connection and the per-key committed spend; reads (usage, get) go
through a second connection on a worker thread, so neither the event loop nor the writer ever
waits on a query. When the database is down the ledger is degraded (health()), not stopped:
rows wait (in the journal, or in memory without one) and the running writer commits them once
it is back; a key's spend counts them meanwhile. Backends: SQLite (ledger_sqlite.py) and
PostgreSQL (ledger_postgres.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Self, TypeVar

from tokenway.billing.dead_letters import DeadLetters
from tokenway.billing.journal import Journal, database_id
from tokenway.billing.pending import Pending
from tokenway.billing.record import UsageRecord
from tokenway.billing.store import USAGE_FIELDS, LedgerStore, LedgerUnavailable, open_store
from tokenway.billing.writer import LedgerWriter, Seed, Write, close_quietly
from tokenway.sql import is_transient

__all__ = ["USAGE_FIELDS", "Ledger", "LedgerHealth", "LedgerUnavailable", "UsageRecord"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LedgerHealth:
    """degraded: the database is not taking rows (since: unix time it began; last_error: the
    latest failure). num_pending_rows: rows recorded by this process and not yet committed, at
    any time. num_rows_dropped: rows without a journal lost past max_pending_rows, since start."""

    degraded: bool
    since: float | None
    num_pending_rows: int
    last_error: str | None
    num_rows_dropped: int


class Ledger:
    """url: sqlite:///abs/path.db or postgresql://... Build it at startup: it opens the database
    (and raises if it cannot).

    batch_max caps the rows of one transaction. max_delay_s is how long a batch may wait for
    batch-mates; the default 0 commits as soon as the writer is free, and the rows that arrive
    during a commit form the next batch: group commit that adds no latency when idle
    (bench/ledger_bench.py: at 300 records/s a 2 ms wait adds 2 ms to p50 and saves no commits).
    A row already safe in the journal that nobody waits for is the exception: it waits up to
    billing/writer.JOURNALED_WINDOW_S for others, so the writer wakes once a window, not a row.
    max_pending_rows: without a journal, how many rows may wait in memory through an outage.
    spend_usd totals count this process's commits on top of the seed: gateways sharing one
    PostgreSQL see each other's spend only when a key is first seeded.
    """

    def __init__(self, url: str, batch_max: int = 256, max_delay_s: float = 0.0,
                 journal_dir: str | Path | None = None, journal_name: str = "0",
                 max_pending_rows: int = 100_000) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        if max_pending_rows < 0:
            raise ValueError(f"max_pending_rows must be >= 0, got {max_pending_rows}")
        self._url = url
        # Where rows go, for startup messages and the journal's header; no user or password.
        self.url = url.split("@", 1)[-1] if url.startswith("postgres") else url
        self.dead_letters = DeadLetters(
            None if journal_dir is None else Path(journal_dir) / f"ledger-{database_id(self.url)}.dead-letters.jsonl")
        self._pending = Pending()
        self._reader: LedgerStore | None = None
        self._reader_lock = threading.Lock()
        self._closed = False
        store = open_store(url)
        try:
            # With a journal, record() returns once the row is in the journal (see journal.py).
            self._journal = None if journal_dir is None else Journal(journal_dir, self.url, journal_name,
                                                                      self.dead_letters)
        except BaseException:
            close_quietly(store)
            raise
        self._writer = LedgerWriter(url, store, self._journal, self.dead_letters, self._pending, batch_max,
                                    max_delay_s, max_pending_rows)
        if self._journal is not None and self._journal.recovered:
            # What an earlier run journaled is committed before anything new and before serving,
            # unless the database fails meanwhile: then it waits in the journal like any row
            # (pending in the spend until committed) and the start goes on.
            waiters: list[Future] = []
            for rec in self._journal.recovered:
                waiters.append(Future())
                self._submit(Write(rec, waiters[-1], journaled=True))
            for waiter in waiters:
                waiter.result()

    @property
    def journal_path(self) -> Path | None:
        return None if self._journal is None else self._journal.path

    @property
    def num_commits(self) -> int:
        return self._writer.num_commits

    @property
    def num_rows_written(self) -> int:
        return self._writer.num_rows_written

    def health(self) -> LedgerHealth:
        outage = self._writer.outage
        return LedgerHealth(degraded=outage is not None, since=None if outage is None else outage.since,
                            num_pending_rows=self._pending.num_rows,
                            last_error=None if outage is None else outage.last_error,
                            num_rows_dropped=self._writer.num_rows_dropped)

    def stats(self) -> dict:
        health = self.health()
        return {"num_commits": self.num_commits, "num_rows_written": self.num_rows_written,
                "num_rows_quarantined": self.dead_letters.num_rows, "degraded": health.degraded,
                "num_pending_rows": health.num_pending_rows, "num_rows_dropped": health.num_rows_dropped}

    async def record(self, rec: UsageRecord) -> None:
        """Return once the row would survive a crash: journaled (with a journal) or committed
        (without; through an outage that is once the database is back, and LedgerUnavailable
        if max_pending_rows rows already wait). Cancelling the caller does not cancel the write."""
        if self._journal is not None:
            self._journal.append(rec)
            self._submit(Write(rec, None, journaled=True))
            return
        committed: Future = Future()
        self._submit(Write(rec, committed))
        await asyncio.wrap_future(committed)

    def record_nowait(self, rec: UsageRecord) -> None:
        """Queue the row and return at once; it joins the next batch. Safe from any thread."""
        if self._journal is not None:
            self._journal.append(rec)
        self._submit(Write(rec, None, journaled=self._journal is not None))

    async def spend_usd(self, key_id: str) -> float:
        """A key's committed cost plus that of the rows this process recorded and has not
        committed yet: never less than what it spent through this process. A dict lookup after
        the first call per key. LedgerUnavailable if the key's committed spend was never read
        and the database is down (there is no lower bound to give then)."""
        writer = self._writer
        if key_id not in writer.key_id_to_spend_usd:
            if self._closed:  # no writer to keep a running total: ask the database
                return await self._read(lambda store: store.spend_usd(key_id)) + self._pending.usd(key_id)
            if writer.outage is not None:
                raise writer.unavailable()
            seeded: Future = Future()
            self._submit(Seed(key_id, seeded))
            await asyncio.wrap_future(seeded)
        # Pending first: the writer adds a commit to the totals before it takes it from pending.
        pending_usd = self._pending.usd(key_id)
        return writer.key_id_to_spend_usd[key_id] + pending_usd

    async def usage(self, key_id: str | None, since: float | None = None, until: float | None = None) -> list[dict]:
        """Committed usage by key, UTC day (of finished_at) and model, ordered by those: rows
        of USAGE_FIELDS."""
        return await self._read(lambda store: store.usage(key_id, since, until))

    async def get(self, request_id: str) -> UsageRecord | None:
        return await self._read(lambda store: store.get(request_id))

    async def recent(self, limit: int) -> list[UsageRecord]:
        return await self._read(lambda store: store.recent(limit))

    async def close(self) -> None:
        """Commit everything queued (one more try if the database is down: what it will not
        take stays in the journal), then stop the writer. Idempotent."""
        if not self._closed:
            self._closed = True
            self._writer.stop()
        await asyncio.to_thread(self._writer.join)
        if self._journal is not None:
            self._journal.close()
        with self._reader_lock:
            close_quietly(self._reader)
            self._reader = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _submit(self, job: Write | Seed) -> None:
        if self._closed:
            raise RuntimeError("ledger is closed")
        if isinstance(job, Write):
            self._pending.add(job.rec)
        self._writer.submit(job)

    async def _read(self, query: Callable[[LedgerStore], T]) -> T:
        def run() -> T:
            error: Exception | None = None
            with self._reader_lock:
                for _ in range(2):  # the second on a new connection: the database may have dropped the first
                    try:
                        self._reader = self._reader or open_store(self._url)
                        return query(self._reader)
                    except Exception as exc:
                        if self._reader is not None and not is_transient(exc):
                            raise
                        close_quietly(self._reader)
                        self._reader = None
                        error = exc
            raise LedgerUnavailable(f"the usage ledger's database is unreachable ({error!r})") from error

        return await asyncio.to_thread(run)
