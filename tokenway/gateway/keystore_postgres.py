"""The key store's PostgreSQL backend (psycopg 3): the same table as SqliteKeys, shared by every
gateway on the database, and a change feed so none of them polls it on the request path.

    a write (any gateway, `tokenway keys`)                        every gateway's change feed thread
      BEGIN; INSERT/UPDATE api_keys; version + 1;                   LISTEN tokenway_api_keys
      pg_notify('tokenway_api_keys', version); COMMIT  ─────────►   wakes, reloads the cache

A notification is sent at COMMIT, never for a rolled-back write, and reaches every listening
connection; one lost with its connection is made up for by the reconnect (which reports a
change) and by the version check every refresh_seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from tokenway.gateway.keystore_backend import (
    COLUMNS,
    KeyStoreUnavailable,
    Snapshot,
    StoredKey,
    check_rotatable,
    decode_row,
    encode_row,
)
from tokenway.sql import close_quietly, is_transient, pg_timeouts

T = TypeVar("T")

CHANNEL = "tokenway_api_keys"
_RETRY_AFTER_S = 5.0
# Any constant (not another store's): serializes CREATE TABLE IF NOT EXISTS between gateways
# starting together (concurrent creates of one table can fail on the catalog's unique index).
_SCHEMA_LOCK_ID = 0x70C3_4E75
_SCHEMA: LiteralString = """
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY, secret_sha256 BYTEA NOT NULL, hint TEXT NOT NULL, name TEXT NOT NULL,
    models JSONB, rpm BIGINT, tpm BIGINT, tpd BIGINT, max_concurrent BIGINT, max_tokens BIGINT,
    budget_usd DOUBLE PRECISION, expires_at DOUBLE PRECISION, created_at DOUBLE PRECISION NOT NULL,
    revoked_at DOUBLE PRECISION, last_used_at DOUBLE PRECISION, safety JSONB, service_tiers JSONB,
    response_cache BOOLEAN);
CREATE TABLE IF NOT EXISTS api_keys_version (id INTEGER PRIMARY KEY CHECK (id = 0), version BIGINT NOT NULL);
INSERT INTO api_keys_version (id, version) VALUES (0, 0) ON CONFLICT (id) DO NOTHING;
"""
_SELECT: LiteralString = "SELECT " + ", ".join(COLUMNS) + " FROM api_keys"
_INSERT: LiteralString = ("INSERT INTO api_keys (" + ", ".join(COLUMNS) + ") VALUES ("
                          + ", ".join("%s" for _ in COLUMNS) + ") ON CONFLICT (key_id) DO NOTHING")
_BUMP: LiteralString = ("WITH bumped AS (UPDATE api_keys_version SET version = version + 1 WHERE id = 0"
                        " RETURNING version) SELECT pg_notify(%s, version::text) FROM bumped")


def _decoded(value: Any) -> Any:
    return value  # psycopg decodes jsonb itself


class PostgresKeys:
    def __init__(self, url: str) -> None:
        try:
            given = conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise ValueError(f"key store url: {exc}") from None
        self._url = url
        self._timeouts = pg_timeouts(given)
        self.where = f"{given.get('host', 'localhost')}:{given.get('port', 5432)}/{given.get('dbname', '')}"
        self._lock = threading.Lock()  # over _conn: administration and cache reloads, from any thread
        self._conn: psycopg.Connection | None = None
        self._feed: psycopg.Connection | None = None  # LISTENs; used by the change feed's thread only
        try:
            conn = self._connection()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_ID,))
                conn.execute(_SCHEMA)
        except psycopg.OperationalError as exc:
            self.close()
            raise KeyStoreUnavailable(self.where, _RETRY_AFTER_S) from exc
        except BaseException:
            self.close()
            raise

    # ---- KeyBackend ------------------------------------------------------------------------------

    def snapshot(self, known_version: int | None, wait: bool) -> Snapshot | None:
        # wait is for SQLite's inline polling; here only the change feed's thread and writers reload.
        def read(conn: psycopg.Connection) -> Snapshot | None:
            # One snapshot for the version and the rows: a write between them cannot be half seen.
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                row = conn.execute("SELECT version FROM api_keys_version WHERE id = 0").fetchone()
                assert row is not None  # made with the schema
                if row[0] == known_version:
                    return None
                rows = conn.execute(_SELECT + " WHERE revoked_at IS NULL").fetchall()
                held = conn.execute("SELECT EXISTS (SELECT 1 FROM api_keys)").fetchone()
            return Snapshot(row[0], [decode_row(r, _decoded) for r in rows], bool(held and held[0]))

        return self._run(read)

    def insert(self, keys: Sequence[StoredKey]) -> bool:
        def write(conn: psycopg.Connection) -> bool:
            try:
                with conn.transaction(), conn.cursor() as cur:
                    for key in keys:
                        cur.execute(_INSERT, encode_row(key, Jsonb))
                        if cur.rowcount != 1:
                            raise _Taken
                    cur.execute(_BUMP, (CHANNEL,))
            except _Taken:
                return False
            return True

        return self._run(write)

    def get(self, key_id: str) -> StoredKey | None:
        row = self._run(lambda conn: conn.execute(_SELECT + " WHERE key_id = %s", (key_id,)).fetchone())
        return decode_row(row, _decoded) if row is not None else None

    def list(self, include_revoked: bool) -> list[StoredKey]:
        query: LiteralString = _SELECT + ("" if include_revoked else " WHERE revoked_at IS NULL")
        rows = self._run(lambda conn: conn.execute(query + " ORDER BY created_at, key_id").fetchall())
        return [decode_row(row, _decoded) for row in rows]

    def revoke(self, key_id: str, now: float) -> bool:
        def write(conn: psycopg.Connection) -> bool:
            with conn.transaction():
                num_changed = conn.execute("UPDATE api_keys SET revoked_at = %s WHERE key_id = %s AND revoked_at"
                                           " IS NULL", (now, key_id)).rowcount
                if num_changed:
                    conn.execute(_BUMP, (CHANNEL,))
            return num_changed == 1

        return self._run(write)

    def rotate(self, key_id: str, secret_sha256: bytes, hint: str) -> None:
        def write(conn: psycopg.Connection) -> None:
            with conn.transaction():
                check_rotatable(key_id, conn.execute("SELECT revoked_at FROM api_keys WHERE key_id = %s FOR UPDATE",
                                                              (key_id,)).fetchone())
                conn.execute("UPDATE api_keys SET secret_sha256 = %s, hint = %s WHERE key_id = %s",
                             (secret_sha256, hint, key_id))
                conn.execute(_BUMP, (CHANNEL,))

        self._run(write)

    def touch(self, key_id_to_used_at: dict[str, float]) -> None:
        def write(conn: psycopg.Connection) -> None:
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany("UPDATE api_keys SET last_used_at = GREATEST(COALESCE(last_used_at, 0), %s)"
                                " WHERE key_id = %s", [(used_at, key_id) for key_id, used_at in
                                                        key_id_to_used_at.items()])

        self._run(write)

    def close(self) -> None:
        with self._lock:
            close_quietly(self._conn)
            self._conn = None
        close_quietly(self._feed)
        self._feed = None

    # ---- ChangeFeed ------------------------------------------------------------------------------

    def wait_for_change(self, timeout_s: float) -> bool:
        if self._feed is None or self._feed.closed:
            feed = psycopg.connect(self._url, autocommit=True, **self._timeouts)
            feed.execute(f"LISTEN {CHANNEL}")
            self._feed = feed
            return True  # what changed while no connection listened is unknown: look
        try:
            for _ in self._feed.notifies(timeout=timeout_s, stop_after=1):
                return True
        except psycopg.Error:
            close_quietly(self._feed)
            self._feed = None
            raise
        return False

    # ---- internals -------------------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            # autocommit: a read leaves no transaction open; writes use transaction blocks
            # (read committed: two gateways bumping the version at once wait, rather than fail).
            self._conn = psycopg.connect(self._url, autocommit=True, **self._timeouts)
        return self._conn

    def _run(self, query: Callable[[psycopg.Connection], T]) -> T:
        """query on the shared connection; a connection that fails gets one more try on a new
        one (the database may have dropped it: a restart, an idle timeout); a new one that fails,
        KeyStoreUnavailable. Each query must be safe to run twice (the first try's commit may
        have landed): a create retried makes a second key_id, whose secret nobody has."""
        with self._lock:
            for attempt in range(2):
                reused = self._conn is not None
                try:
                    return query(self._connection())
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    close_quietly(self._conn)
                    self._conn = None
                    if not reused or attempt == 1:
                        raise KeyStoreUnavailable(self.where, _RETRY_AFTER_S) from exc
        raise AssertionError("unreachable")


class _Taken(Exception):
    """A key_id to insert is in the table already: the transaction rolls back."""
