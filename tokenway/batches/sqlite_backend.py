"""The batch store's SQLite dialect: the ledger's file (WAL, synchronous=NORMAL, as the ledger
opens it), or ":memory:" for a server without a database.

Space: a batch's lines and files are most of what the file holds, and come and go. The file is
made auto_vacuum = INCREMENTAL, so the pages a delete frees can be given back: purge_files (each
runner upkeep) runs reclaim(), an incremental vacuum a few MiB a write, then truncates the WAL.
SQLite switches a file that already has tables (made before, or by the keys' or ledger's
connection first) only by a VACUUM, which rewrites the whole file under its write lock: the
first connection does that once for a file up to SWITCH_BY_VACUUM_BYTES (well under a second);
a larger one is left as it is, with a warning naming the one-off command, and its freed pages
are reused by later writes (the file stops growing; it does not shrink).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString

from tokenway.batches import schema
from tokenway.batches.backend import BatchBackend, Cursor

logger = logging.getLogger(__name__)

_SCHEMA = schema.schema("REAL", "BLOB")
INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL
SWITCH_BY_VACUUM_BYTES = 64 * 2**20
RECLAIM_STEP_PAGES = 2048  # pages an incremental_vacuum frees per write: 8 MiB of 4 KiB pages
RECLAIM_MIN_PAGES = 256  # free pages below this are left for the next writes to reuse
JOURNAL_SIZE_LIMIT = 64 * 2**20  # a WAL that a large create grew is cut back to this once checkpointed
BUSY_TIMEOUT_MS = 10_000
CHECKPOINT_WAIT_MS = 200


class SqliteBatchBackend(BatchBackend):
    def __init__(self, path: str) -> None:
        # isolation_level=None: each statement commits on its own, unless in transaction().
        # check_same_thread=False: the store closes its connections from the thread that closes it.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._incremental = False
        self._wal_to_truncate = False  # pages were moved since the WAL was last truncated
        try:
            if path != ":memory:":
                # The file is the ledger's and the keys' too: wait out their write locks.
                self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                # The mode is the file's, kept once set: switching takes an exclusive lock that
                # SQLite may refuse at once (no busy wait) while another connection reads.
                if self._conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = NORMAL")
                self._conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
                self._incremental = _make_incremental(self._conn, path)
            for statement in _SCHEMA:
                self._conn.execute(statement)
            have = {row[1] for row in self._conn.execute("PRAGMA table_info(batches)")}
            for name, kind in schema.added_columns("REAL"):
                if name not in have:
                    self._conn.execute(f"ALTER TABLE batches ADD COLUMN {name} {kind}")
            self._conn.execute(schema.FORWARDED_INDEX)
        except BaseException:
            self._conn.close()
            raise

    def execute(self, sql: LiteralString, params: Sequence[Any] = ()) -> Cursor:
        return self._conn.execute(sql, params)

    def executemany(self, sql: LiteralString, rows: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        # IMMEDIATE: the write lock is taken as the transaction begins, so two writers never both
        # read, then both try to write (a deadlock SQLite breaks by failing one).
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def reclaim(self) -> None:
        """The free pages given back to the file system, a step (one short write) at a time, then
        the WAL truncated (it holds the moved pages until checkpointed)."""
        if not self._incremental:
            return
        while (num_free := self._conn.execute("PRAGMA freelist_count").fetchone()[0]) >= RECLAIM_MIN_PAGES:
            # A script: the pragma frees a page a step, and execute() steps it once (one page, whatever N).
            self._conn.executescript(f"PRAGMA incremental_vacuum({RECLAIM_STEP_PAGES});")
            self._wal_to_truncate = True
            if self._conn.execute("PRAGMA freelist_count").fetchone()[0] >= num_free:
                break
        if self._wal_to_truncate:
            # A TRUNCATE checkpoint holds off writers (the ledger's) while it waits for readers: it
            # waits briefly, and a busy one is tried again at the next reclaim.
            self._conn.execute(f"PRAGMA busy_timeout = {CHECKPOINT_WAIT_MS}")
            try:
                busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            finally:
                self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._wal_to_truncate = bool(busy)

    def close(self) -> None:
        self._conn.close()


def _make_incremental(conn: sqlite3.Connection, path: str) -> bool:
    """Whether the file is auto_vacuum = INCREMENTAL, made so if it can be (the module's docstring)."""
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == INCREMENTAL:
        return True
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes at once on a file with no table yet
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == INCREMENTAL:
        return True
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size > SWITCH_BY_VACUUM_BYTES:
        logger.warning("batch store: %s (%.0f MiB) was made without auto_vacuum, so the space deleted batches and "
                       "files leave is reused but not given back. To switch it, once, with the server stopped: "
                       "sqlite3 %s 'PRAGMA auto_vacuum = INCREMENTAL; VACUUM;'", path, size / 2**20, path)
        return False
    try:
        conn.execute("VACUUM")
    except sqlite3.OperationalError as exc:  # another connection's transaction: the next connection tries again
        logger.info("batch store: the one-off VACUUM to switch %s to auto_vacuum waits for a later try: %s", path, exc)
        return False
    return conn.execute("PRAGMA auto_vacuum").fetchone()[0] == INCREMENTAL
