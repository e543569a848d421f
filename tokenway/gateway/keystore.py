"""API keys in SQLite, and the in-memory cache that authenticates every request.

    table api_keys           one row per key ever created; revoked rows stay, with revoked_at
    table api_keys_version   one row: bumped in the same transaction as every create, revoke, rotate

The store may share its SQLite file with the usage ledger: it owns only these two tables and
its own connection. The gateway and `tokenway keys` (another process) write the same file.

authenticate() never touches SQLite on a cache hit: it parses the key_id out of the secret,
looks it up in `key_id_to_entry` and compares SHA-256 digests in constant time. At most every
`refresh_seconds` one call reads api_keys_version and, only if it moved, reloads the table; so
a revoke or rotate made by another process takes effect within refresh_seconds, and one made
through this store at once. (PRAGMA data_version would be cheaper still, but the ledger's
writes to the same file would change it on every request.)
"""

from __future__ import annotations

import hmac
import json
import logging
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from tokenway.gateway.auth import (
    Principal,
    check_key_fields,
    check_service_tiers,
    hash_secret,
    key_id_of,
    new_key_id,
    new_secret,
    secret_hint,
)
from tokenway.protocol.errors import FieldError
from tokenway.protocol.job import ServiceClass
from tokenway.safety.screen import SafetyPolicy

logger = logging.getLogger(__name__)

DEFAULT_REFRESH_SECONDS = 2.0
_NUM_ID_ATTEMPTS = 8  # 32-bit key_ids: a collision is rare, eight in a row is impossible

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
_LIMIT_COLUMNS = ("rpm", "tpm", "tpd", "max_concurrent", "max_tokens", "budget_usd", "expires_at")
_COLUMNS = ("key_id", "name", "models", *_LIMIT_COLUMNS, "created_at", "revoked_at", "last_used_at", "hint",
            "safety", "service_tiers", "response_cache")


class UnknownKeyError(ValueError):
    """No key has this key_id."""


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A key as listed: its limits and history, and a hint; never the secret or its hash."""

    key_id: str
    name: str
    models: tuple[str, ...] | None
    rpm: int | None
    tpm: int | None
    tpd: int | None
    max_concurrent: int | None
    max_tokens: int | None
    budget_usd: float | None
    expires_at: float | None
    created_at: float
    revoked_at: float | None
    last_used_at: float | None
    hint: str  # "tw-k_3f9a2c1b-…a9Zq"
    safety: SafetyPolicy | None = None
    service_tiers: tuple[ServiceClass, ...] | None = None  # None: the server's default grant
    response_cache: bool | None = None  # None: the model's setting

    def status(self, now: float) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["models"] = list(self.models) if self.models is not None else None
        data["safety"] = self.safety.to_dict() if self.safety is not None else None
        data["service_tiers"] = list(self.service_tiers) if self.service_tiers is not None else None
        return data


@dataclass(frozen=True, slots=True)
class _Entry:
    secret_sha256: bytes
    principal: Principal


class KeyStore:
    def __init__(self, sqlite_path: str | Path, refresh_seconds: float = DEFAULT_REFRESH_SECONDS) -> None:
        if refresh_seconds < 0:
            raise FieldError("refresh_seconds", f"must be >= 0, got {refresh_seconds!r}")
        self.path = Path(sqlite_path)
        self.refresh_seconds = refresh_seconds
        if str(sqlite_path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, shared by the event loop and worker threads under `_lock`.
        self._conn = sqlite3.connect(str(sqlite_path), isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 5000")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.executescript(_SCHEMA)
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(api_keys)")}
            if "safety" not in columns:  # a database from before per-key safety policies
                self._conn.execute("ALTER TABLE api_keys ADD COLUMN safety TEXT")
            if "service_tiers" not in columns:  # ... and before per-key service tiers
                self._conn.execute("ALTER TABLE api_keys ADD COLUMN service_tiers TEXT")
            if "response_cache" not in columns:  # ... and before per-key response caching
                self._conn.execute("ALTER TABLE api_keys ADD COLUMN response_cache INTEGER")
        # Replaced whole, never mutated, so a reader needs no lock.
        self._key_id_to_entry: dict[str, _Entry] = {}
        self._version = -1
        self._checked_at = float("-inf")  # time.monotonic() of the last version check
        self._key_id_to_last_used: dict[str, float] = {}  # flushed by flush_last_used()
        self._refresh(force=True)

    # ---- the request path ------------------------------------------------------------------------

    def authenticate(self, secret: str) -> Principal | None:
        """The key's Principal; None for a malformed, unknown, wrong, revoked or expired secret."""
        key_id = key_id_of(secret)
        if key_id is None:
            return None
        entry = self._entry(key_id)
        if entry is None or not hmac.compare_digest(entry.secret_sha256, hash_secret(secret)):
            return None
        now = time.time()
        if entry.principal.is_expired(now):
            return None
        self._key_id_to_last_used[key_id] = now
        return entry.principal

    def principal(self, key_id: str) -> Principal | None:
        """An active key's Principal by its id, from the cache authenticate() reads (None:
        unknown, revoked or expired): for work a key submitted earlier, such as a batch's lines."""
        entry = self._entry(key_id)
        if entry is None or entry.principal.is_expired(time.time()):
            return None
        return entry.principal

    def _entry(self, key_id: str) -> _Entry | None:
        if time.monotonic() - self._checked_at >= self.refresh_seconds:
            self._refresh(force=False)
        return self._key_id_to_entry.get(key_id)

    # ---- administration --------------------------------------------------------------------------

    def create(self, name: str, models: tuple[str, ...] | list[str] | None = None, rpm: int | None = None,
               tpm: int | None = None, tpd: int | None = None, max_concurrent: int | None = None,
               max_tokens: int | None = None, budget_usd: float | None = None,
               expires_at: float | None = None, safety: SafetyPolicy | None = None,
               service_tiers: tuple[ServiceClass, ...] | list[ServiceClass] | None = None,
               response_cache: bool | None = None) -> tuple[str, KeyInfo]:
        """A new key; the secret is returned here once and stored only as a hash. service_tiers:
        the tiers its calls may run at (None: the server's default grant); response_cache:
        whether its calls may be answered from the response cache (None: as the model says)."""
        models = tuple(models) if models is not None else None
        service_tiers = tuple(service_tiers) if service_tiers is not None else None
        check_key_fields(name, models, rpm, tpm, tpd, max_concurrent, max_tokens, budget_usd, expires_at)
        check_service_tiers(service_tiers)
        now = time.time()
        if expires_at is not None and expires_at <= now:
            raise FieldError("expires_at", "must be in the future")
        for _ in range(_NUM_ID_ATTEMPTS):
            key_id = new_key_id()
            secret = new_secret(key_id)
            try:
                with self._write() as conn:
                    conn.execute(
                        f"INSERT INTO api_keys (key_id, secret_sha256, hint, name, models, {', '.join(_LIMIT_COLUMNS)},"
                        f" created_at, safety, service_tiers, response_cache)"
                        f" VALUES (?, ?, ?, ?, ?, {', '.join('?' * len(_LIMIT_COLUMNS))}, ?, ?, ?, ?)",
                        (key_id, hash_secret(secret), secret_hint(secret), name,
                         json.dumps(list(models)) if models is not None else None,
                         rpm, tpm, tpd, max_concurrent, max_tokens, budget_usd, expires_at, now,
                         json.dumps(safety.to_dict()) if safety is not None else None,
                         json.dumps(list(service_tiers)) if service_tiers is not None else None,
                         None if response_cache is None else int(response_cache)))
            except sqlite3.IntegrityError:
                continue  # key_id taken
            break
        else:
            raise RuntimeError("could not find a free key_id")
        logger.info("api key %s created (name %r)", key_id, name)
        info = self.get(key_id)
        assert info is not None
        return secret, info

    def get(self, key_id: str) -> KeyInfo | None:
        with self._lock:
            row = self._conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM api_keys WHERE key_id = ?",
                                     (key_id,)).fetchone()
        return _key_info(row) if row is not None else None

    def list(self, include_revoked: bool = True) -> list[KeyInfo]:
        where = "" if include_revoked else "WHERE revoked_at IS NULL"
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM api_keys {where} ORDER BY created_at, key_id").fetchall()
        return [_key_info(row) for row in rows]

    def revoke(self, key_id: str) -> bool:
        """True if the key was live and is now revoked; False if unknown or already revoked."""
        with self._write() as conn:
            num_changed = conn.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                                       (time.time(), key_id)).rowcount
        if num_changed:
            logger.info("api key %s revoked", key_id)
        return num_changed == 1

    def rotate(self, key_id: str) -> str:
        """A new secret for the same key_id and limits; the old one stops working at once here,
        and within refresh_seconds in other processes. UnknownKeyError / ValueError if revoked."""
        secret = new_secret(key_id)
        with self._write() as conn:
            row = conn.execute("SELECT revoked_at FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                raise UnknownKeyError(f"no API key {key_id!r}")
            if row[0] is not None:
                raise ValueError(f"API key {key_id} is revoked; create a new one instead")
            conn.execute("UPDATE api_keys SET secret_sha256 = ?, hint = ? WHERE key_id = ?",
                         (hash_secret(secret), secret_hint(secret), key_id))
        logger.info("api key %s rotated", key_id)
        return secret

    def count_active(self) -> int:
        """Keys neither revoked nor expired, from the cache (so at most refresh_seconds old):
        cheap enough to ask on the request path, e.g. whether auth may stay off."""
        if time.monotonic() - self._checked_at >= self.refresh_seconds:
            self._refresh(force=False)
        now = time.time()
        return sum(not entry.principal.is_expired(now) for entry in self._key_id_to_entry.values())

    def flush_last_used(self) -> None:
        """Writes when each key was last used. Call it off the request path (a periodic task):
        authenticate() only notes the time in memory."""
        pending, self._key_id_to_last_used = self._key_id_to_last_used, {}
        if pending:
            with self._lock:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    self._conn.executemany(
                        "UPDATE api_keys SET last_used_at = max(coalesce(last_used_at, 0), ?) WHERE key_id = ?",
                        [(used_at, key_id) for key_id, used_at in pending.items()])
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    def close(self) -> None:
        self.flush_last_used()
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------

    def _write(self) -> _WriteTransaction:
        return _WriteTransaction(self)

    def _refresh(self, force: bool) -> None:
        """Reloads the cache if the version moved (or `force`). A caller that finds another
        thread refreshing goes on with the current cache rather than wait."""
        if not self._lock.acquire(blocking=force):
            return
        try:
            self._checked_at = time.monotonic()
            (version,) = self._conn.execute("SELECT version FROM api_keys_version WHERE id = 0").fetchone()
            if version == self._version and not force:
                return
            rows = self._conn.execute(
                f"SELECT secret_sha256, {', '.join(_COLUMNS)} FROM api_keys WHERE revoked_at IS NULL").fetchall()
        except sqlite3.Error:
            # Keep serving from the cache we have; the next call after refresh_seconds retries.
            logger.warning("could not refresh the API key cache from %s", self.path, exc_info=True)
            return
        finally:
            self._lock.release()
        key_id_to_entry = {}
        for row in rows:
            try:
                key_id_to_entry[row[1]] = _Entry(row[0], _principal(_key_info(row[1:])))
            except ValueError:
                logger.warning("api key %s has an invalid row in %s; it is ignored", row[1], self.path)
        self._key_id_to_entry = key_id_to_entry
        self._version = version


class _WriteTransaction:
    """BEGIN IMMEDIATE ... bump the version ... COMMIT, then reload this store's cache, so a
    change made here is seen here at once."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        self.store._conn.execute("BEGIN IMMEDIATE")
        return self.store._conn

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        conn = self.store._conn
        try:
            if exc_type is None:
                conn.execute("UPDATE api_keys_version SET version = version + 1 WHERE id = 0")
                conn.execute("COMMIT")
            else:
                conn.execute("ROLLBACK")
        finally:
            self.store._lock.release()
        if exc_type is None:
            self.store._refresh(force=True)


def _key_info(row: tuple) -> KeyInfo:
    values = dict(zip(_COLUMNS, row))
    values["models"] = tuple(json.loads(values["models"])) if values["models"] is not None else None
    values["safety"] = SafetyPolicy.from_dict(json.loads(values["safety"])) if values["safety"] is not None else None
    tiers = values["service_tiers"]
    values["service_tiers"] = tuple(json.loads(tiers)) if tiers is not None else None
    values["response_cache"] = None if values["response_cache"] is None else bool(values["response_cache"])
    return KeyInfo(**values)


def _principal(info: KeyInfo) -> Principal:
    return Principal(key_id=info.key_id, name=info.name, models=info.models, rpm=info.rpm, tpm=info.tpm,
                     tpd=info.tpd, max_concurrent=info.max_concurrent, max_tokens=info.max_tokens,
                     budget_usd=info.budget_usd, expires_at=info.expires_at, safety=info.safety,
                     service_tiers=info.service_tiers, response_cache=info.response_cache)
