"""The key store's SQLite backend: the embedded default, one file per gateway host.

    table api_keys           one row per key ever created; revoked rows stay, with revoked_at
                             (so any row at all means a key has existed: auth stays on)
    table api_keys_version   one row: bumped in the same transaction as every create, revoke, rotate

The file may be the usage ledger's too: this backend owns only these two tables and its own
connection. The gateway and `tokenway keys` (another process) write the same file; a reader
sees another process's change by polling api_keys_version (PRAGMA data_version would be
cheaper still, but the ledger's writes to the same file would change it on every request).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from tokenway.gateway.keystore_backend import (
    COLUMNS,
    Snapshot,
    StoredKey,
    check_rotatable,
    decode_row,
    encode_row,
    json_text,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    secret_sha256 BLOB NOT NULL,
    hint TEXT NOT NULL,
    name TEXT NOT NULL,
    models TEXT,                -- JSON array of served model names; NULL: all
    rpm INTEGER, tpm INTEGER, tpd INTEGER, max_concurrent INTEGER, max_tokens INTEGER,
    budget_usd REAL,
    expires_at REAL,            -- unix seconds; NULL: never
    created_at REAL NOT NULL,
    revoked_at REAL,
    last_used_at REAL,
    safety TEXT,                -- JSON SafetyPolicy; NULL: the model's or the server's
    service_tiers TEXT,         -- JSON array of service tiers; NULL: the server's default grant
    response_cache INTEGER      -- 1 or 0: the key's answers may (not) come from the response cache; NULL: the model's
);
CREATE TABLE IF NOT EXISTS api_keys_version (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL);
INSERT OR IGNORE INTO api_keys_version (id, version) VALUES (0, 0);
"""
# Columns added after the first release, with their types: a database from before gains them.
_ADDED_COLUMNS = (("safety", "TEXT"), ("service_tiers", "TEXT"), ("response_cache", "INTEGER"))
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM api_keys"
_INSERT = f"INSERT INTO api_keys ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_BUMP = "UPDATE api_keys_version SET version = version + 1 WHERE id = 0"


class SqliteKeys:
    def __init__(self, path: str | Path) -> None:
        """path: a file (its folder made if missing), or ":memory:"."""
        self.where = str(path)
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # One connection, shared by the event loop and worker threads under `_lock`.
        self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 5000")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.executescript(_SCHEMA)
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(api_keys)")}
            for name, kind in _ADDED_COLUMNS:
                if name not in columns:
                    self._conn.execute(f"ALTER TABLE api_keys ADD COLUMN {name} {kind}")

    def snapshot(self, known_version: int | None, wait: bool) -> Snapshot | None:
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            (version,) = self._conn.execute("SELECT version FROM api_keys_version WHERE id = 0").fetchone()
            if version == known_version:
                return None
            rows = self._conn.execute(f"{_SELECT} WHERE revoked_at IS NULL").fetchall()
            (has_held_keys,) = self._conn.execute("SELECT EXISTS (SELECT 1 FROM api_keys)").fetchone()
        finally:
            self._lock.release()
        return Snapshot(version, [decode_row(row, json.loads) for row in rows], bool(has_held_keys))

    def insert(self, keys: Sequence[StoredKey]) -> bool:
        try:
            with self._write() as conn:
                conn.executemany(_INSERT, [encode_row(key, json_text) for key in keys])
        except sqlite3.IntegrityError:
            return False
        return True

    def get(self, key_id: str) -> StoredKey | None:
        with self._lock:
            row = self._conn.execute(f"{_SELECT} WHERE key_id = ?", (key_id,)).fetchone()
        return decode_row(row, json.loads) if row is not None else None

    def list(self, include_revoked: bool) -> list[StoredKey]:
        where = "" if include_revoked else "WHERE revoked_at IS NULL"
        with self._lock:
            rows = self._conn.execute(f"{_SELECT} {where} ORDER BY created_at, key_id").fetchall()
        return [decode_row(row, json.loads) for row in rows]

    def revoke(self, key_id: str, now: float) -> bool:
        with self._write() as conn:
            return conn.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                                (now, key_id)).rowcount == 1

    def rotate(self, key_id: str, secret_sha256: bytes, hint: str) -> None:
        with self._write() as conn:
            row = conn.execute("SELECT revoked_at FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
            check_rotatable(key_id, row)
            conn.execute("UPDATE api_keys SET secret_sha256 = ?, hint = ? WHERE key_id = ?",
                         (secret_sha256, hint, key_id))

    def touch(self, key_id_to_used_at: dict[str, float]) -> None:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(
                    "UPDATE api_keys SET last_used_at = max(coalesce(last_used_at, 0), ?) WHERE key_id = ?",
                    [(used_at, key_id) for key_id, used_at in key_id_to_used_at.items()])
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _write(self) -> _WriteTransaction:
        return _WriteTransaction(self._conn, self._lock)


class _WriteTransaction:
    """BEGIN IMMEDIATE ... bump the version ... COMMIT (ROLLBACK on an exception)."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock) -> None:
        self.conn, self.lock = conn, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.conn

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        try:
            if exc_type is None:
                self.conn.execute(_BUMP)
                self.conn.execute("COMMIT")
            else:
                self.conn.execute("ROLLBACK")
        finally:
            self.lock.release()
