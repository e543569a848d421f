"""The response store's SQLite backend: the ledger's file by default (WAL, synchronous=NORMAL, as
the ledger opens it), or ":memory:" for a server without a database, bounded by MemoryBudget."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Mapping

from tokenway.conversations.backend import (
    COLUMNS,
    FINAL,
    INDEXES,
    STATUS_CHECK,
    USAGE_COLUMNS,
    USAGE_DEFINITION,
    chain_sql,
    delete_sql,
    dumps,
    expire_sql,
    from_row,
    insert_sql,
    purge_sql,
    renew_params,
    renew_sql,
    row_values,
    select_sql,
    stale_sql,
    turn_from_row,
    update_sql,
)
from tokenway.conversations.store import JSONObject, ResponseStatus, ResponseUsage, StoredResponse, Turn

# A rowid table, not WITHOUT ROWID: its rows carry whole conversations' JSON, far past the
# small rows WITHOUT ROWID suits; the id's own index finds them.
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS stored_responses (
    id TEXT PRIMARY KEY, key_id TEXT NOT NULL, created_at REAL NOT NULL,
    status TEXT NOT NULL CHECK ({STATUS_CHECK}), model TEXT NOT NULL, previous_response_id TEXT,
    instructions TEXT, input_items TEXT NOT NULL, response TEXT NOT NULL, metadata TEXT NOT NULL,
    lease_until REAL, prompt_tokens {USAGE_DEFINITION}, cached_tokens {USAGE_DEFINITION},
    completion_tokens {USAGE_DEFINITION});
"""
_INSERT = insert_sql("?")
_SELECT = select_sql(", ".join(COLUMNS), "?")
_SELECT_INPUT_ITEMS = select_sql("input_items", "?")
_DELETE = delete_sql("?")
_CHAIN = chain_sql("?", "COALESCE(json_extract(r.response, '$.output'), '[]')")
_STALE = stale_sql("?")
_RENEW = renew_sql("?")
# Columns a table made by an earlier release lacks, in the order they were added.
_ADDED_COLUMNS = (("lease_until", "REAL"), *((column, USAGE_DEFINITION) for column in USAGE_COLUMNS))
_EXPIRE = expire_sql("?")
_PURGE = purge_sql("?")


def _add_columns(conn: sqlite3.Connection) -> None:
    """A table made before a column existed gains it (SQLite has no ADD COLUMN IF NOT EXISTS)."""
    existing = {row[1] for row in conn.execute("PRAGMA table_info(stored_responses)")}
    for column, definition in _ADDED_COLUMNS:
        if column in existing:
            continue
        try:
            conn.execute(f"ALTER TABLE stored_responses ADD COLUMN {column} {definition}")
        except sqlite3.OperationalError as exc:  # another connection added it since
            if "duplicate column" not in str(exc):
                raise


class MemoryBudget:
    """What the in-memory store keeps: the newest responses within max_bytes (characters of
    their JSON), the oldest dropped first; the newest always stays. Exact because that
    database has one connection, the one this budget's backend holds."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.response_id_to_num_bytes: dict[str, int] = {}  # oldest first (insertion order)

    def add(self, response_id: str, num_bytes: int) -> None:
        self.response_id_to_num_bytes[response_id] = num_bytes
        self.num_bytes += num_bytes

    def grow(self, response_id: str, num_bytes: int) -> None:
        # In place: a response updated keeps its age.
        self.response_id_to_num_bytes[response_id] += num_bytes
        self.num_bytes += num_bytes

    def remove(self, response_id: str) -> None:
        self.num_bytes -= self.response_id_to_num_bytes.pop(response_id, 0)

    def over(self) -> Iterator[str]:
        """The oldest response ids to drop, one at a time, while the budget is exceeded."""
        while self.num_bytes > self.max_bytes and len(self.response_id_to_num_bytes) > 1:
            response_id = next(iter(self.response_id_to_num_bytes))
            self.remove(response_id)
            yield response_id


class SqliteBackend:
    def __init__(self, path: str, max_bytes: int | None = None) -> None:
        """max_bytes: for ":memory:" only, the MemoryBudget."""
        if (max_bytes is not None) != (path == ":memory:"):
            raise ValueError("max_bytes bounds an in-memory store, and only that")
        # isolation_level=None: each statement commits on its own. check_same_thread=False: the
        # store closes its connections from the thread that closes it.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            if max_bytes is None:
                # The file is the ledger's and the keys' too: wait out their write locks.
                self._conn.execute("PRAGMA busy_timeout = 10000")
                # The mode is the file's, kept once set: switching takes an exclusive lock that
                # SQLite may refuse at once (no busy wait) while another connection reads.
                if self._conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.executescript(_SCHEMA)
            _add_columns(self._conn)
            for index in INDEXES:
                self._conn.execute(index)
        except BaseException:
            self._conn.close()
            raise
        self._budget = None if max_bytes is None else MemoryBudget(max_bytes)

    def insert(self, response: StoredResponse) -> None:
        values = row_values(response, dumps)
        if self._conn.execute(_INSERT, values).rowcount == 1 and self._budget is not None:
            self._budget.add(response.id, sum(len(value) for value in values if isinstance(value, str)))
            self._evict()

    def update(self, response_id: str, status: ResponseStatus, response: JSONObject,
               from_statuses: tuple[ResponseStatus, ...]) -> bool:
        text = dumps(response)
        old = None
        if self._budget is not None:  # the size it replaces (no other connection writes between)
            old = self._conn.execute("SELECT length(response) FROM stored_responses WHERE id = ?",
                                     (response_id,)).fetchone()
        updated = self._conn.execute(update_sql("?", len(from_statuses)),
                                     (status, text, response_id, *from_statuses)).rowcount == 1
        if updated and self._budget is not None and old is not None:
            self._budget.grow(response_id, len(text) - old[0])
            self._evict()
        return updated

    def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        row = self._conn.execute(_SELECT, (response_id, key_id)).fetchone()
        return None if row is None else from_row(row, json.loads)

    def delete(self, response_id: str, key_id: str) -> bool:
        deleted = self._conn.execute(_DELETE, (response_id, key_id)).rowcount == 1
        if deleted and self._budget is not None:
            self._budget.remove(response_id)
        return deleted

    def chain(self, response_id: str, key_id: str, max_depth: int) -> list[Turn]:
        rows = self._conn.execute(_CHAIN, (response_id, key_id, key_id, max_depth)).fetchall()
        return [turn_from_row(row, json.loads) for row in rows]

    def input_items(self, response_id: str, key_id: str) -> tuple[JSONObject, ...] | None:
        row = self._conn.execute(_SELECT_INPUT_ITEMS, (response_id, key_id)).fetchone()
        return None if row is None else tuple(json.loads(row[0]))

    def renew(self, response_id_to_usage: Mapping[str, ResponseUsage], lease_until: float) -> int:
        # One transaction: one commit for the lot, not one a response.
        self._conn.execute("BEGIN")
        try:
            num_renewed = self._conn.executemany(_RENEW, renew_params(response_id_to_usage, lease_until)).rowcount
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        return num_renewed

    def stale(self, now: float, unleased_before: float) -> list[StoredResponse]:
        return [from_row(row, json.loads) for row in self._conn.execute(_STALE, (now, unleased_before))]

    def expire(self, response_id: str, response: JSONObject, now: float, unleased_before: float) -> bool:
        text = dumps(response)
        old = None
        if self._budget is not None:
            old = self._conn.execute("SELECT length(response) FROM stored_responses WHERE id = ?",
                                     (response_id,)).fetchone()
        expired = self._conn.execute(_EXPIRE, (text, response_id, now, unleased_before)).rowcount == 1
        if expired and self._budget is not None and old is not None:
            self._budget.grow(response_id, len(text) - old[0])
        return expired

    def purge(self, created_before: float, limit: int) -> int:
        if self._budget is None:
            return self._conn.execute(_PURGE, (created_before, limit)).rowcount
        # In memory: the budget forgets each one (no RETURNING before SQLite 3.35).
        response_ids = [row[0] for row in self._conn.execute(
            f"SELECT id FROM stored_responses WHERE created_at < ? AND {FINAL} LIMIT ?", (created_before, limit))]
        for response_id in response_ids:
            self._conn.execute("DELETE FROM stored_responses WHERE id = ?", (response_id,))
            self._budget.remove(response_id)
        return len(response_ids)

    def close(self) -> None:
        self._conn.close()

    def _evict(self) -> None:
        assert self._budget is not None
        for response_id in self._budget.over():
            self._conn.execute("DELETE FROM stored_responses WHERE id = ?", (response_id,))
