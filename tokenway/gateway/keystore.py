"""API keys: the in-memory cache that authenticates every request, and the rules of creating,
revoking, rotating, exporting and importing keys, over a backend that holds the table:

    KeyStore("/path/tokenway.db")            SQLite (keystore_sqlite.py): the embedded default
    KeyStore("postgresql://host/db")         PostgreSQL (keystore_postgres.py): one store for every gateway

authenticate() never touches the database: it parses the key_id out of the secret, looks it up
in `key_id_to_entry` and compares SHA-256 digests in constant time. The cache learns of a change
made through this store at once (the write reloads it), and of another process's change

    SQLite      by polling: at most every `refresh_seconds` one call reads the table's version
                and, only if it moved, reloads the table (a file read, cheap enough inline);
    PostgreSQL  by LISTEN/NOTIFY on a thread of its own, within milliseconds; the same thread
                also reads the version every `refresh_seconds`, in case a notification was lost
                with its connection. No request ever waits on the network for a key.

While the database is unreachable, calls are still authenticated from the cache (a revocation
made meanwhile waits for it to come back); administration fails with KeyStoreUnavailable.
"""

from __future__ import annotations

import hmac
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Self

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
from tokenway.gateway.extras import missing_package
from tokenway.gateway.keystore_backend import (
    ChangeFeed,
    KeyBackend,
    KeyInfo,
    KeyStoreUnavailable,
    StoredKey,
    UnknownKeyError,
)
from tokenway.gateway.keystore_sqlite import SqliteKeys
from tokenway.protocol.errors import FieldError
from tokenway.protocol.job import ServiceClass
from tokenway.safety.screen import SafetyPolicy
from tokenway.sql import is_transient

__all__ = ["KeyInfo", "KeyStore", "KeyStoreUnavailable", "StoredKey", "UnknownKeyError", "ImportConflict"]

logger = logging.getLogger(__name__)

DEFAULT_REFRESH_SECONDS = 2.0
_NUM_ID_ATTEMPTS = 8  # 32-bit key_ids: a collision is rare, eight in a row is impossible
_WAKE_S = 0.25  # how often the change feed's thread looks up from its wait (and so how long close() takes)
_FEED_RETRY_S = 1.0  # after the change feed's connection failed
_TOUCH_EVERY_S = 30.0  # how often the change feed's thread writes last_used_at
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class ImportConflict(ValueError):
    """Rows to import whose key_id the store holds with other values."""


def open_backend(store: str | Path) -> KeyBackend:
    """A path or sqlite:///path: SQLite; postgresql://...: PostgreSQL (psycopg, the [scale] extra)."""
    text = str(store)
    if text.startswith(POSTGRES_SCHEMES):
        missing = missing_package("--store-url", text)
        if missing is not None:
            raise RuntimeError(missing)
        from tokenway.gateway.keystore_postgres import PostgresKeys  # psycopg is only needed for this backend

        return PostgresKeys(text)
    if "://" in text and not text.startswith("sqlite:///"):
        raise FieldError("store_url", f"must be a SQLite file, sqlite:///path or postgresql://..., got {text!r}")
    return SqliteKeys(text.removeprefix("sqlite://") if text.startswith("sqlite:///") else store)


@dataclass(frozen=True, slots=True)
class _Entry:
    secret_sha256: bytes
    principal: Principal


@dataclass(frozen=True, slots=True)
class ImportResult:
    num_added: int
    num_unchanged: int  # already there, the same in every field but last_used_at


class KeyStore:
    def __init__(self, store: str | Path, refresh_seconds: float = DEFAULT_REFRESH_SECONDS) -> None:
        """store: a SQLite file (or sqlite:///path, or ":memory:") or a postgresql:// url."""
        if refresh_seconds < 0:
            raise FieldError("refresh_seconds", f"must be >= 0, got {refresh_seconds!r}")
        self.refresh_seconds = refresh_seconds
        self._backend = open_backend(store)
        self.where = self._backend.where  # for messages: never a password
        self.path = Path(store) if isinstance(self._backend, SqliteKeys) and "://" not in str(store) else None
        # Replaced whole, never mutated, so a reader needs no lock.
        self._key_id_to_entry: dict[str, _Entry] = {}
        self._version: int | None = None
        # Whether the table has ever held a key: only ever goes from False to True here.
        self._has_held_keys = False
        self._checked_at = float("-inf")  # time.monotonic() of the last version check
        self._refreshing = threading.Lock()  # one reload at a time, so an older one never replaces a newer
        self._key_id_to_last_used: dict[str, float] = {}  # flushed by flush_last_used()
        try:
            self._refresh(force=True)
        except BaseException:
            self._backend.close()
            raise
        self._closed = threading.Event()
        self._feed: threading.Thread | None = None
        if isinstance(self._backend, ChangeFeed):
            self._feed = threading.Thread(target=self._follow, args=(self._backend,), name="keystore-feed",
                                          daemon=True)
            self._feed.start()

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

    def count_active(self) -> int:
        """Keys neither revoked nor expired, from the cache (so at most refresh_seconds old):
        cheap enough to ask on the request path, e.g. whether auth may stay off."""
        self._poll()
        now = time.time()
        return sum(not entry.principal.is_expired(now) for entry in self._key_id_to_entry.values())

    def has_held_keys(self) -> bool:
        """Whether the store holds any key, revoked and expired ones included, from the cache (at
        most refresh_seconds old): what keeps auth on once a key has existed (auth.py AuthPolicy)."""
        self._poll()
        return self._has_held_keys

    def _entry(self, key_id: str) -> _Entry | None:
        self._poll()
        return self._key_id_to_entry.get(key_id)

    def _poll(self) -> None:
        if self._feed is None and time.monotonic() - self._checked_at >= self.refresh_seconds:
            self._refresh(force=False)

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
            info = KeyInfo(key_id=key_id, name=name, models=models, rpm=rpm, tpm=tpm, tpd=tpd,
                           max_concurrent=max_concurrent, max_tokens=max_tokens, budget_usd=budget_usd,
                           expires_at=expires_at, created_at=now, revoked_at=None, last_used_at=None,
                           hint=secret_hint(secret), safety=safety, service_tiers=service_tiers,
                           response_cache=response_cache)
            if self._backend.insert([StoredKey(hash_secret(secret), info)]):
                break
        else:
            raise RuntimeError("could not find a free key_id")
        self._refresh(force=True)
        logger.info("api key %s created (name %r)", key_id, name)
        return secret, info

    def get(self, key_id: str) -> KeyInfo | None:
        key = self._backend.get(key_id)
        return key.info if key is not None else None

    def list(self, include_revoked: bool = True) -> list[KeyInfo]:
        return [key.info for key in self._backend.list(include_revoked)]

    def revoke(self, key_id: str) -> bool:
        """True if the key was live and is now revoked; False if unknown or already revoked."""
        revoked = self._backend.revoke(key_id, time.time())
        self._refresh(force=True)
        if revoked:
            logger.info("api key %s revoked", key_id)
        return revoked

    def rotate(self, key_id: str) -> str:
        """A new secret for the same key_id and limits; the old one stops working at once here,
        and in other processes as soon as they learn of it. UnknownKeyError / ValueError if revoked."""
        secret = new_secret(key_id)
        if key_id_of(secret) != key_id:  # no key has an id of another shape (the admin API's path takes any)
            raise UnknownKeyError(f"no API key {key_id!r}")
        self._backend.rotate(key_id, hash_secret(secret), secret_hint(secret))
        self._refresh(force=True)
        logger.info("api key %s rotated", key_id)
        return secret

    def export(self) -> list[StoredKey]:
        """Every key, revoked ones too, with its secret's hash: what `tokenway keys import`
        takes into another store (the secrets themselves exist nowhere)."""
        return self._backend.list(include_revoked=True)

    def import_keys(self, keys: Iterable[StoredKey]) -> ImportResult:
        """Adds the keys this store lacks, in one transaction. A key it holds already with the
        same values (last_used_at aside) is left as it is, so importing twice changes nothing;
        one it holds with other values (another secret, other limits, revoked on one side
        only) is a conflict, and then nothing is added (ImportConflict names them)."""
        new: dict[str, StoredKey] = {}
        num_unchanged = 0
        conflicts = []
        for key in keys:
            key_id = key.info.key_id
            held = new.get(key_id) or self._backend.get(key_id)
            if held is None:
                new[key_id] = key
            elif _same(held, key):
                num_unchanged += key_id not in new
            else:
                conflicts.append(key_id)
        if conflicts:
            raise ImportConflict(_conflict_message(conflicts))
        if new and not self._backend.insert(list(new.values())):
            raise ImportConflict("another process added some of these keys meanwhile; import again to see which")
        self._refresh(force=True)
        logger.info("api keys imported: %d added, %d already there", len(new), num_unchanged)
        return ImportResult(len(new), num_unchanged)

    def flush_last_used(self) -> None:
        """Writes when each key was last used. Call it off the request path (a periodic task):
        authenticate() only notes the time in memory."""
        pending, self._key_id_to_last_used = self._key_id_to_last_used, {}
        if pending:
            self._backend.touch(pending)

    def close(self) -> None:
        self._closed.set()
        if self._feed is not None:
            self._feed.join()
        try:
            self.flush_last_used()
        except Exception as exc:  # the database is gone: a key's last use is not worth failing a shutdown
            if not is_transient(exc) and not isinstance(exc, KeyStoreUnavailable):
                raise
            logger.warning("api keys: last use not written to %s: %r", self.where, exc)
        finally:
            self._backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------

    def _refresh(self, force: bool, wait: bool | None = None) -> None:
        """Reloads the cache if the version moved (or `force`). A caller that finds another
        thread refreshing goes on with the current cache rather than wait, unless `wait` (by
        default: when forced): the change feed waits, as the reload under way may have begun
        before the change it was told of."""
        wait = force if wait is None else wait
        if not self._refreshing.acquire(blocking=wait):
            return
        try:
            self._checked_at = time.monotonic()
            try:
                snapshot = self._backend.snapshot(None if force else self._version, wait=wait)
            except Exception as exc:
                if self._version is None:  # the first load: a store that cannot be read is no store
                    raise
                # Keep serving from the cache we have; the next refresh retries.
                logger.warning("could not refresh the API key cache from %s: %r", self.where, exc,
                               exc_info=not isinstance(exc, (sqlite3.Error, KeyStoreUnavailable)))
                return
            if snapshot is None:
                return
            key_id_to_entry = {}
            for key in snapshot.keys:
                try:
                    key_id_to_entry[key.info.key_id] = _Entry(key.secret_sha256, _principal(key.info))
                except ValueError:
                    logger.warning("api key %s has an invalid row in %s; it is ignored", key.info.key_id, self.where)
            self._key_id_to_entry = key_id_to_entry
            self._version = snapshot.version
            self._has_held_keys = self._has_held_keys or snapshot.has_held_keys
        finally:
            self._refreshing.release()

    def _follow(self, feed: ChangeFeed) -> None:
        """The change feed's thread: reload on a notification, or after refresh_seconds without
        one; write last_used_at now and then."""
        touched_at = time.monotonic()
        while not self._closed.is_set():
            try:
                changed = feed.wait_for_change(_WAKE_S)
            except Exception as exc:  # the feed's connection is gone; it reconnects on the next wait
                logger.warning("api keys: the change feed from %s failed (%r); polling every %g s until it is "
                               "back", self.where, exc, self.refresh_seconds)
                changed = False
                self._closed.wait(_FEED_RETRY_S)
            if changed or time.monotonic() - self._checked_at >= self.refresh_seconds:
                self._refresh(force=False, wait=True)
            if time.monotonic() - touched_at >= _TOUCH_EVERY_S:
                touched_at = time.monotonic()
                try:
                    self.flush_last_used()
                except (KeyStoreUnavailable, sqlite3.Error) as exc:
                    logger.warning("api keys: last use not written to %s: %r", self.where, exc)


def _same(held: StoredKey, given: StoredKey) -> bool:
    return (hmac.compare_digest(held.secret_sha256, given.secret_sha256)
            and replace(held.info, last_used_at=None) == replace(given.info, last_used_at=None))


def _conflict_message(key_ids: list[str]) -> str:
    shown = ", ".join(key_ids[:10]) + (f" and {len(key_ids) - 10} more" if len(key_ids) > 10 else "")
    return (f"{len(key_ids)} key(s) are in the store already with another secret or other values: {shown}; "
            "nothing was imported")


def _principal(info: KeyInfo) -> Principal:
    return Principal(key_id=info.key_id, name=info.name, models=info.models, rpm=info.rpm, tpm=info.tpm,
                     tpd=info.tpd, max_concurrent=info.max_concurrent, max_tokens=info.max_tokens,
                     budget_usd=info.budget_usd, expires_at=info.expires_at, safety=info.safety,
                     service_tiers=info.service_tiers, response_cache=info.response_cache)
