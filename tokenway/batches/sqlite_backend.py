"""The batch store's SQLite dialect: the ledger's file (WAL, synchronous=NORMAL, as the ledger
opens it), or ":memory:" for a server without a database."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString

from tokenway.batches import schema
from tokenway.batches.backend import BatchBackend, Cursor

_SCHEMA = schema.schema("REAL", "BLOB")


class SqliteBatchBackend(BatchBackend):
    def __init__(self, path: str) -> None:
        # isolation_level=None: each statement commits on its own, unless in transaction().
        # check_same_thread=False: the store closes its connections from the thread that closes it.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            if path != ":memory:":
                # The file is the ledger's and the keys' too: wait out their write locks.
                self._conn.execute("PRAGMA busy_timeout = 10000")
                # The mode is the file's, kept once set: switching takes an exclusive lock that
                # SQLite may refuse at once (no busy wait) while another connection reads.
                if self._conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = NORMAL")
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

    def close(self) -> None:
        self._conn.close()
