"""The usage ledger: exactly one durable row per request, written by group commit.

    request path ── record(UsageRecord) ──► queue ──► writer thread: up to batch_max rows (or
    max_delay_s) per transaction, INSERT ... ON CONFLICT (request_id) DO NOTHING, COMMIT
    ◄── record() returns once the row's transaction has committed ──┘

The writer thread owns its own connection and the per-key running spend totals; reads
(usage, get) go through a second connection on a worker thread, so neither the event loop
nor the writer ever waits on a query. Backends: SQLite (WAL, synchronous=NORMAL: a commit
survives a killed process, though not a power cut) and PostgreSQL (ledger_postgres.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from tokenway.billing.dead_letters import DeadLetters
from tokenway.billing.journal import Journal, database_id

logger = logging.getLogger(__name__)
T = TypeVar("T")

COLUMNS = ("request_id", "key_id", "model", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd",
           "finish_reason", "error", "status", "stages_ms", "started_at", "finished_at", "trace")
JSON_COLUMNS = ("stages_ms", "trace")
USAGE_FIELDS = ("key_id", "day", "model", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                "cost_usd")


@dataclass(slots=True)
class UsageRecord:
    """One request's bill. cached_tokens is part of prompt_tokens; timestamps are unix seconds."""

    request_id: str
    key_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    finish_reason: str | None
    error: str | None
    status: int
    stages_ms: dict[str, float]
    started_at: float
    finished_at: float
    # The rest of the request's trace (observability/traces.py) as of the commit: endpoint,
    # ttft_ms, tpot_ms, total_ms, cache_reason... so `tokenway trace` outlives the ring.
    trace: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Whatever text a client managed to put in (a lone surrogate in an echoed model name, a
        # NUL), the row must stay writable to every backend.
        self.request_id, self.key_id, self.model = (storable_text(self.request_id), storable_text(self.key_id),
                                                    storable_text(self.model))
        if self.finish_reason is not None:
            self.finish_reason = storable_text(self.finish_reason)
        if self.error is not None:
            self.error = storable_text(self.error)
        self.trace = storable(self.trace)
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        # NaN or inf would make the row unreadable JSON (and a budget that never trips).
        if not math.isfinite(self.cost_usd) or self.cost_usd < 0:
            raise ValueError(f"cost_usd must be finite and >= 0, got {self.cost_usd}")
        if not all(math.isfinite(ms) for ms in self.stages_ms.values()):
            raise ValueError("stages_ms values must be finite")

    def to_row(self, encode_json: Callable[[dict], Any] = json.dumps) -> tuple:
        """Values in COLUMNS order, the JSON columns encoded for the backend."""
        return tuple(encode_json(getattr(self, name)) if name in JSON_COLUMNS else getattr(self, name)
                     for name in COLUMNS)

    @classmethod
    def from_row(cls, row: Sequence, decode_json: Callable[[Any], dict] = json.loads) -> "UsageRecord":
        return cls(*(decode_json(value) if name in JSON_COLUMNS else value for name, value in zip(COLUMNS, row)))


def storable_text(text: str) -> str:
    """`text` with what no backend can store made visible instead: a lone surrogate (not
    encodable as UTF-8) becomes its escape `\\ud800`, a NUL (refused by PostgreSQL text and
    jsonb) becomes `\\x00`."""
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00") if "\x00" in text else text


def storable(value: Any) -> Any:
    """storable_text applied to every string (keys included) of a JSON-like value."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def is_transient(exc: BaseException) -> bool:
    """A failure of the database or the connection (retry later, keep the rows), as opposed to
    one of the rows themselves (quarantine that row)."""
    if isinstance(exc, (OSError, sqlite3.OperationalError)):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


class LedgerStore(Protocol):
    """One connection to one backend. Used from one thread at a time."""

    def insert(self, records: Sequence[UsageRecord]) -> list[UsageRecord]:
        """Insert in one transaction and commit; return the records actually written (not duplicates)."""

    def spend_usd(self, key_id: str) -> float: ...

    def usage(self, key_id: str | None, since: float | None, until: float | None) -> list[dict]: ...

    def get(self, request_id: str) -> UsageRecord | None: ...

    def recent(self, limit: int) -> list[UsageRecord]:
        """The last `limit` rows by finished_at, newest first."""

    def close(self) -> None: ...


def usage_filter(key_id: str | None, since: float | None, until: float | None, mark: str) -> tuple[str, list]:
    """The WHERE clause of usage(): since inclusive, until exclusive, on finished_at."""
    conditions, params = [], []
    for condition, value in (("key_id = ", key_id), ("finished_at >= ", since), ("finished_at < ", until)):
        if value is not None:
            conditions.append(condition + mark)
            params.append(value)
    return (" WHERE " + " AND ".join(conditions)) if conditions else "", params


_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_ledger (
    request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL,
    stages_ms TEXT NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL,
    trace TEXT NOT NULL DEFAULT '{}');
CREATE INDEX IF NOT EXISTS usage_ledger_key_finished ON usage_ledger (key_id, finished_at);
CREATE INDEX IF NOT EXISTS usage_ledger_finished ON usage_ledger (finished_at);
"""


class SqliteStore:
    def __init__(self, path: str) -> None:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves; the file may be shared with
        # other modules' tables, so wait for their write locks instead of failing.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA busy_timeout = 10000")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = NORMAL")
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(usage_ledger)")}
        if columns and "trace" not in columns:  # a ledger from before traces were kept
            self._conn.execute("ALTER TABLE usage_ledger ADD COLUMN trace TEXT NOT NULL DEFAULT '{}'")
        self._conn.executescript(_SQLITE_SCHEMA)
        self._insert_sql = (f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
                            " ON CONFLICT (request_id) DO NOTHING")

    def insert(self, records: Sequence[UsageRecord]) -> list[UsageRecord]:
        written = []
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            for rec in records:
                if self._conn.execute(self._insert_sql, rec.to_row()).rowcount == 1:
                    written.append(rec)
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        return written

    def spend_usd(self, key_id: str) -> float:
        return self._conn.execute("SELECT COALESCE(SUM(cost_usd), 0.0) FROM usage_ledger WHERE key_id = ?",
                                  (key_id,)).fetchone()[0]

    def usage(self, key_id: str | None, since: float | None, until: float | None) -> list[dict]:
        where, params = usage_filter(key_id, since, until, "?")
        rows = self._conn.execute(
            "SELECT key_id, date(finished_at, 'unixepoch') AS day, model, COUNT(*), SUM(prompt_tokens),"
            " SUM(cached_tokens), SUM(completion_tokens), SUM(cost_usd) FROM usage_ledger" + where +
            " GROUP BY key_id, day, model ORDER BY key_id, day, model", params).fetchall()
        return [dict(zip(USAGE_FIELDS, row)) for row in rows]

    def get(self, request_id: str) -> UsageRecord | None:
        row = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_ledger WHERE request_id = ?",
                                 (request_id,)).fetchone()
        return None if row is None else UsageRecord.from_row(row)

    def recent(self, limit: int) -> list[UsageRecord]:
        rows = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY finished_at DESC LIMIT ?",
                                  (limit,)).fetchall()
        return [UsageRecord.from_row(row) for row in rows]

    def close(self) -> None:
        self._conn.close()


def open_store(url: str) -> LedgerStore:
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path or path == "/:memory:":
            raise ValueError(f"ledger url {url!r}: use sqlite:///absolute/path.db (a file both connections share)")
        return SqliteStore(path)
    if url.startswith(("postgresql://", "postgres://")):
        from tokenway.billing.ledger_postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(f"ledger url {url!r}: expected sqlite:///path.db or postgresql://...")


@dataclass(slots=True)
class _Write:
    rec: UsageRecord
    waiter: Future | None  # None: record_nowait
    journaled: bool = False


@dataclass(slots=True)
class _Seed:
    """Load one key's spend from the DB into the running totals, in the writer's commit order."""

    key_id: str
    waiter: Future


_STOP = None  # queue sentinel: flush what is queued, then exit


class Ledger:
    """url: sqlite:///abs/path.db or postgresql://... Build it at startup: it opens the database.

    batch_max caps the rows of one transaction. max_delay_s is how long a batch may wait for
    batch-mates; the default 0 commits as soon as the writer is free, and the rows that arrive
    during a commit form the next batch: group commit that adds no latency when idle
    (bench/ledger_bench.py: at 300 records/s a 2 ms wait adds 2 ms to p50 and saves no commits).
    spend_usd totals count this process's commits on top of the seed: gateways sharing one
    PostgreSQL see each other's spend only when a key is first seeded.
    """

    def __init__(self, url: str, batch_max: int = 256, max_delay_s: float = 0.0,
                 journal_dir: str | Path | None = None, journal_name: str = "0") -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        self._url, self._batch_max, self._max_delay_s = url, batch_max, max_delay_s
        # Where rows go, for startup messages and the journal's header; no user or password.
        self.url = url.split("@", 1)[-1] if url.startswith("postgres") else url
        self._queue: queue.SimpleQueue[_Write | _Seed | None] = queue.SimpleQueue()
        # Written only by the writer thread, after a commit; readers see a float swap (atomic).
        self._key_id_to_spend_usd: dict[str, float] = {}
        self.num_commits = 0
        self.num_rows_written = 0
        self.dead_letters = DeadLetters(
            None if journal_dir is None else Path(journal_dir) / f"ledger-{database_id(self.url)}.dead-letters.jsonl")
        self._reader: LedgerStore | None = None
        self._reader_lock = threading.Lock()
        self._closed = False
        opened: Future = Future()
        self._writer = threading.Thread(target=self._write_loop, args=(opened,), name="ledger-writer", daemon=True)
        self._writer.start()
        opened.result()  # raise here, at startup, if the database cannot be opened
        # With a journal, record() returns once the row is in the journal (see journal.py).
        self._journal = None if journal_dir is None else Journal(journal_dir, self.url, journal_name,
                                                                  self.dead_letters)
        if self._journal is not None and self._journal.recovered:
            # Commit what an earlier run journaled before anything new (and before serving);
            # a row that cannot be stored is quarantined, so this never stops a start.
            waiters = [self._submit(_Write(rec, Future(), journaled=True)) for rec in self._journal.recovered]
            for waiter in waiters:
                waiter.result()

    @property
    def journal_path(self) -> Path | None:
        return None if self._journal is None else self._journal.path

    def stats(self) -> dict:
        return {"num_commits": self.num_commits, "num_rows_written": self.num_rows_written,
                "num_rows_quarantined": self.dead_letters.num_rows}

    async def record(self, rec: UsageRecord) -> None:
        """Return once the row would survive a crash: journaled (with a journal) or committed
        (without). Cancelling the caller does not cancel the write."""
        if self._journal is not None:
            self._journal.append(rec)
            self._submit(_Write(rec, None, journaled=True))
            return
        await asyncio.wrap_future(self._submit(_Write(rec, Future())))

    def record_nowait(self, rec: UsageRecord) -> None:
        """Queue the row and return at once; it joins the next batch. Safe from any thread."""
        if self._journal is not None:
            self._journal.append(rec)
        self._submit(_Write(rec, None, journaled=self._journal is not None))

    async def spend_usd(self, key_id: str) -> float:
        """Total committed cost of a key: a dict lookup after the first call per key."""
        total = self._key_id_to_spend_usd.get(key_id)
        if total is not None:
            return total
        if self._closed:  # no writer to keep a running total: ask the database
            return await self._read(lambda store: store.spend_usd(key_id))
        return await asyncio.wrap_future(self._submit(_Seed(key_id, Future())))

    async def usage(self, key_id: str | None, since: float | None = None, until: float | None = None) -> list[dict]:
        """Committed usage by key, UTC day (of finished_at) and model, ordered by those."""
        return await self._read(lambda store: store.usage(key_id, since, until))

    async def get(self, request_id: str) -> UsageRecord | None:
        return await self._read(lambda store: store.get(request_id))

    async def recent(self, limit: int) -> list[UsageRecord]:
        return await self._read(lambda store: store.recent(limit))

    async def close(self) -> None:
        """Commit everything queued, then stop the writer. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        await asyncio.to_thread(self._writer.join)
        if self._journal is not None:
            self._journal.close()
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _submit(self, job: _Write | _Seed) -> Future:
        if self._closed:
            raise RuntimeError("ledger is closed")
        self._queue.put(job)
        return job.waiter

    async def _read(self, query: Callable[[LedgerStore], T]) -> T:
        def run() -> T:
            with self._reader_lock:
                if self._reader is None:
                    self._reader = open_store(self._url)
                return query(self._reader)

        return await asyncio.to_thread(run)

    # ---- the writer thread ----

    def _write_loop(self, opened: Future) -> None:
        try:
            store: LedgerStore | None = open_store(self._url)
        except BaseException as exc:
            opened.set_exception(exc)
            return
        opened.set_result(None)
        stopping = False
        while not stopping:
            batch = self._next_batch()
            stopping = batch[-1] is _STOP
            writes = [job for job in batch if isinstance(job, _Write)]
            if writes:
                store = self._commit(store, writes)
            for job in batch:
                if isinstance(job, _Seed):
                    store = self._seed(store, job)
        _close_quietly(store)
        # A record() that raced close() past its check: fail it rather than leave it waiting.
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if job is not _STOP:
                _settle([job.waiter], RuntimeError("ledger is closed"))

    def _next_batch(self) -> list[_Write | _Seed | None]:
        """Block for one job, then take whatever else is queued (waiting up to max_delay_s for
        more) until batch_max; a stop takes everything left."""
        batch = [self._queue.get()]
        deadline = time.monotonic() + self._max_delay_s
        while batch[-1] is not _STOP and len(batch) < self._batch_max:
            try:
                timeout = deadline - time.monotonic()
                batch.append(self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        if batch[-1] is not _STOP and self._closed:  # _STOP may still be queued behind a full batch
            batch.extend(iter(self._queue.get, _STOP))  # close() puts _STOP right after setting _closed
            batch.append(_STOP)
        return batch

    def _commit(self, store: LedgerStore | None, writes: list[_Write]) -> LedgerStore | None:
        store, written, error = self._insert(store, [job.rec for job in writes], tries=2)
        done, failed = (writes, []) if error is None else ([], writes)
        if error is not None and not is_transient(error):
            # Some row cannot be stored (a value the backend refuses): find it by committing
            # the rows one at a time, and quarantine it so the rows behind it go through.
            error = None
            for index, job in enumerate(writes):
                store, rows, row_error = self._insert(store, [job.rec], tries=1)
                if row_error is not None and is_transient(row_error):
                    done, failed, error = writes[:index], writes[index:], row_error
                    break
                if row_error is not None:
                    self.dead_letters.add("commit", repr(row_error), row=dataclasses.asdict(job.rec))
                written += rows
            else:
                done, failed = writes, []
        if failed:
            # The database is unreachable: rows that were journaled stay in the journal for the
            # next start; the others are lost, and their callers hear so.
            num_lost = sum(job.waiter is None for job in failed)
            if num_lost and self._journal is None:
                logger.error("usage ledger: %d fire-and-forget rows lost: %r", num_lost, error)
            elif num_lost:
                logger.error("usage ledger: %d rows not committed (%r); they stay in the journal for the next start",
                             num_lost, error)
            _settle([job.waiter for job in failed], error)
        if not done:
            return store
        self.num_commits += 1
        self.num_rows_written += len(written)
        if self._journal is not None:
            self._journal.committed(sum(job.journaled for job in done))  # quarantined rows are handled too
        for rec in written:
            total = self._key_id_to_spend_usd.get(rec.key_id)
            if total is not None:  # unseeded keys are summed from the DB when first asked
                self._key_id_to_spend_usd[rec.key_id] = total + rec.cost_usd
        _settle([job.waiter for job in done], None)
        return store

    def _insert(self, store: LedgerStore | None, records: list[UsageRecord],
                tries: int) -> tuple[LedgerStore | None, list[UsageRecord], Exception | None]:
        """(store, the records written, None) or (store, [], the last error); reconnects
        between tries: a restarted PostgreSQL or a dropped connection should not cost rows."""
        error: Exception | None = None
        for attempt in range(tries):
            try:
                store = store or open_store(self._url)
                return store, store.insert(records), None
            except Exception as exc:
                logger.warning("usage ledger: commit of %d rows failed (attempt %d): %r", len(records), attempt + 1,
                               exc)
                error = exc
                if store is not None and not is_transient(exc):
                    break  # the rows' fault, not the connection's: trying again would fail again
                _close_quietly(store)
                store = None
        return store, [], error

    def _seed(self, store: LedgerStore | None, job: _Seed) -> LedgerStore | None:
        try:
            store = store or open_store(self._url)
            total = self._key_id_to_spend_usd.get(job.key_id)
            if total is None:
                total = self._key_id_to_spend_usd[job.key_id] = store.spend_usd(job.key_id)
        except Exception as exc:
            _settle([job.waiter], exc)
            _close_quietly(store)
            return None
        _settle([job.waiter], total)
        return store


def _settle(waiters: list[Future | None], outcome: Any) -> None:
    for waiter in waiters:
        if waiter is None:
            continue
        try:  # the caller may have been cancelled (client gone): its row is written all the same
            if isinstance(outcome, BaseException):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)
        except InvalidStateError:
            pass


def _close_quietly(store: LedgerStore | None) -> None:
    if store is not None:
        try:
            store.close()
        except Exception as exc:  # already failing: the connection is dropped either way
            logger.debug("usage ledger: closing a failed connection: %r", exc)
