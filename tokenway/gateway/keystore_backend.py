"""What the key store's backends share: a key as listed (KeyInfo) and as stored (StoredKey),
the table's columns and how a row maps to them, and the protocol each backend speaks.

    KeyStore (keystore.py: the cache authenticate() reads, and the rules)
      └─ KeyBackend: SqliteKeys (keystore_sqlite.py)      one file; readers poll its version
                     PostgresKeys (keystore_postgres.py)  shared by every gateway; LISTEN/NOTIFY

Every write that changes who may call (create, revoke, rotate, import) bumps one version
counter in the same transaction; a cache reloads when it moved. A key's last use is no such
change: it is written apart and bumps nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from tokenway.gateway.auth import check_key_fields, check_service_tiers
from tokenway.protocol.errors import FieldError
from tokenway.protocol.job import ServiceClass
from tokenway.safety.screen import SafetyPolicy

# The table's columns in the order every backend selects and inserts them.
COLUMNS = ("key_id", "secret_sha256", "hint", "name", "models", "rpm", "tpm", "tpd", "max_concurrent",
           "max_tokens", "budget_usd", "expires_at", "created_at", "revoked_at", "last_used_at", "safety",
           "service_tiers", "response_cache")
_JSON_COLUMNS = frozenset({"models", "safety", "service_tiers"})
_SHA256_BYTES = 32


class UnknownKeyError(ValueError):
    """No key has this key_id."""


class KeyStoreUnavailable(Exception):
    """The key store's database cannot be reached; try again after retry_after_s. Calls keep
    being authenticated from the cache meanwhile: only administration needs the database."""

    def __init__(self, where: str, retry_after_s: float) -> None:
        super().__init__(f"the key store at {where} is unreachable; try again in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


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
class StoredKey:
    """A key's row: its KeyInfo and the SHA-256 of its secret (never the secret itself)."""

    secret_sha256: bytes
    info: KeyInfo

    def to_dict(self) -> dict[str, Any]:
        """One line of `tokenway keys export`."""
        return {**self.info.to_dict(), "secret_sha256": self.secret_sha256.hex()}

    @classmethod
    def from_dict(cls, data: Any) -> StoredKey:
        """A line of `tokenway keys export`, checked as a new key's fields are (FieldError)."""
        if not isinstance(data, dict):
            raise FieldError("key", "must be a JSON object")
        fields: dict[str, Any] = {name: data.get(name) for name in COLUMNS}
        unknown = sorted(set(data) - set(COLUMNS))
        if unknown:
            raise FieldError(unknown[0], "is not a field of an exported key")
        try:
            secret_sha256 = bytes.fromhex(fields["secret_sha256"])
        except (TypeError, ValueError):
            secret_sha256 = b""
        if len(secret_sha256) != _SHA256_BYTES:
            raise FieldError("secret_sha256", "must be 64 hex digits")
        for name in ("key_id", "hint"):
            if not isinstance(fields[name], str) or not fields[name]:
                raise FieldError(name, "must be a non-empty string")
        for name in ("created_at", "revoked_at", "last_used_at"):
            value = fields[name]
            if (value is None and name != "created_at") or (isinstance(value, (int, float))
                                                            and not isinstance(value, bool)):
                continue
            raise FieldError(name, "must be unix seconds" + ("" if name == "created_at" else " or null"))
        for name, kind in (("models", list), ("service_tiers", list), ("safety", dict)):
            if fields[name] is not None and not isinstance(fields[name], kind):
                raise FieldError(name, f"must be {'an array' if kind is list else 'an object'} or null")
        if fields["response_cache"] is not None and not isinstance(fields["response_cache"], bool):
            raise FieldError("response_cache", "must be true, false or null")
        fields["secret_sha256"] = secret_sha256
        try:
            key = decode_row(tuple(fields[name] for name in COLUMNS), lambda value: value)
        except (TypeError, ValueError) as exc:  # a safety policy or a list of the wrong shape
            if isinstance(exc, FieldError):
                raise
            raise FieldError("key", str(exc)) from None
        check_info(key.info)
        return key


def check_info(info: KeyInfo) -> None:
    """FieldError for a KeyInfo no key may have: what create() checks, for keys made elsewhere."""
    check_key_fields(info.name, info.models, info.rpm, info.tpm, info.tpd, info.max_concurrent, info.max_tokens,
                     info.budget_usd, info.expires_at)
    check_service_tiers(info.service_tiers)


def check_rotatable(key_id: str, row: Sequence[Any] | None) -> None:
    """Before a rotation, the key's (revoked_at,) row as read under the write's lock: UnknownKeyError
    when there is none, ValueError when it is revoked."""
    if row is None:
        raise UnknownKeyError(f"no API key {key_id!r}")
    if row[0] is not None:
        raise ValueError(f"API key {key_id} is revoked; create a new one instead")


def encode_row(key: StoredKey, json_value: Callable[[Any], Any]) -> tuple:
    """The row's values in COLUMNS order; json_value wraps the JSON columns' values as the
    database takes them (a JSON string, or psycopg's Jsonb)."""
    data = asdict(key.info)
    data["secret_sha256"] = key.secret_sha256
    info = key.info
    data["models"] = list(info.models) if info.models is not None else None
    data["safety"] = info.safety.to_dict() if info.safety is not None else None
    data["service_tiers"] = list(info.service_tiers) if info.service_tiers is not None else None
    return tuple(json_value(data[name]) if name in _JSON_COLUMNS and data[name] is not None else data[name]
                 for name in COLUMNS)


def decode_row(row: Sequence[Any], json_value: Callable[[Any], Any]) -> StoredKey:
    """A row in COLUMNS order (json_value: how the database gave back a JSON column: a string
    to parse, or the value itself). Not checked: a Principal made from it is."""
    values: dict[str, Any] = dict(zip(COLUMNS, row, strict=True))
    for name in _JSON_COLUMNS:
        if values[name] is not None:
            values[name] = json_value(values[name])
    secret_sha256 = bytes(values.pop("secret_sha256"))
    values["models"] = tuple(values["models"]) if values["models"] is not None else None
    values["safety"] = SafetyPolicy.from_dict(values["safety"]) if values["safety"] is not None else None
    values["service_tiers"] = tuple(values["service_tiers"]) if values["service_tiers"] is not None else None
    values["response_cache"] = None if values["response_cache"] is None else bool(values["response_cache"])
    return StoredKey(secret_sha256, KeyInfo(**values))


def json_text(value: Any) -> str:
    return json.dumps(value)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The live (unrevoked) keys as of one version of the table, and whether it holds any row
    at all: a key that ever existed, revoked or expired, keeps auth on (auth.py AuthPolicy)."""

    version: int
    keys: list[StoredKey]
    has_held_keys: bool


class KeyBackend(Protocol):
    where: str  # the database, for messages: a path, or host/dbname without a password

    def snapshot(self, known_version: int | None, wait: bool) -> Snapshot | None:
        """The live keys (and whether any row exists), unless known_version is still the table's
        version (then None). wait
        False: None at once, too, if another thread is using the connection (the request path
        must not queue behind a write)."""
        ...

    def insert(self, keys: Sequence[StoredKey]) -> bool:
        """All of them in one transaction, or none (False) if one's key_id is taken."""
        ...

    def get(self, key_id: str) -> StoredKey | None: ...

    def list(self, include_revoked: bool) -> list[StoredKey]:
        """Oldest first."""
        ...

    def revoke(self, key_id: str, now: float) -> bool:
        """True if it was live and is now revoked."""
        ...

    def rotate(self, key_id: str, secret_sha256: bytes, hint: str) -> None:
        """UnknownKeyError; ValueError if revoked."""
        ...

    def touch(self, key_id_to_used_at: dict[str, float]) -> None:
        """Each key's last_used_at, to the later of the stored one and the given one."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ChangeFeed(Protocol):
    """A backend that says when the table changed, so a cache need not ask on the request path."""

    def wait_for_change(self, timeout_s: float) -> bool:
        """True when the table may have changed (a notification, or a new connection that may
        have missed some); False after timeout_s without one. Blocks: call it on a thread of its own."""
        ...
