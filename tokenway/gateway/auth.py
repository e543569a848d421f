"""Who is calling: the Principal a request runs as, and how a secret becomes one.

    Authorization: Bearer tw-k_3f9a2c1b-<43 url-safe chars>      (or x-api-key: <same>)
      -> secret_from_headers -> KeyStore.authenticate (keystore.py) -> Principal | None
      -> principal_for raises AuthenticationError (401); authorize_model PermissionDeniedError (403)

Whether a call must present a key at all is AuthPolicy's answer (--auth auto | on | off, the
bind address, the admin key, and whether the key store has ever held a key).

A secret is `tw-<key_id>-<random>`. The key_id is public: it appears in key lists, logs and
the usage ledger. Only the random part is secret, and only the SHA-256 of the whole secret is
stored. A secret is never logged, never put into an error message and never held by a
Principal or KeyInfo.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenway.protocol.errors import AuthenticationError, FieldError, PermissionDeniedError, truncate
from tokenway.protocol.job import SERVICE_CLASSES, ServiceClass
from tokenway.safety.screen import SafetyPolicy

if TYPE_CHECKING:
    from tokenway.gateway.keystore import KeyInfo, KeyStore, UnknownKeyError  # noqa: F401

SECRET_PREFIX = "tw-"
KEY_ID_PREFIX = "k_"
NUM_KEY_ID_HEX = 8
NUM_SECRET_BYTES = 32  # token_urlsafe(32): 43 chars, 256 random bits
MAX_SECRET_CHARS = 200  # longer header values are rejected before hashing
MAX_NAME_CHARS = 200
ANONYMOUS_KEY_ID = "anonymous"


def check_key_fields(name: str, models: tuple[str, ...] | None, rpm: int | None, tpm: int | None,
                     tpd: int | None, max_concurrent: int | None, max_tokens: int | None,
                     budget_usd: float | None, expires_at: float | None) -> None:
    """ValueError naming the first bad field. Shared by Principal and KeyStore.create."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise FieldError("name", f"must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    if models is not None:
        if not isinstance(models, tuple) or not models:
            raise FieldError("models", "must be a non-empty tuple of model names, or None for all models")
        if not all(isinstance(m, str) and m.strip() for m in models):
            raise FieldError("models", "every model name must be a non-empty string")
    for field_name, value in (("rpm", rpm), ("tpm", tpm), ("tpd", tpd), ("max_concurrent", max_concurrent),
                              ("max_tokens", max_tokens)):
        # bool is an int subclass: True would silently mean a limit of 1.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise FieldError(field_name, f"must be a positive integer or None, got {value!r}")
    if budget_usd is not None and (isinstance(budget_usd, bool) or not isinstance(budget_usd, (int, float))
                                   or not math.isfinite(budget_usd) or budget_usd < 0):
        raise FieldError("budget_usd", f"must be a finite number >= 0 or None, got {budget_usd!r}")
    if expires_at is not None and (isinstance(expires_at, bool) or not isinstance(expires_at, (int, float))
                                   or not math.isfinite(expires_at)):
        raise FieldError("expires_at", f"must be unix seconds or None, got {expires_at!r}")


def check_service_tiers(service_tiers: tuple[ServiceClass, ...] | None) -> None:
    """FieldError unless None (the server's default grant) or distinct service classes."""
    if service_tiers is None:
        return
    if (not isinstance(service_tiers, tuple) or not service_tiers
            or any(tier not in SERVICE_CLASSES for tier in service_tiers)
            or len(set(service_tiers)) != len(service_tiers)):
        raise FieldError("service_tiers", f"must be one or more distinct tiers of {', '.join(SERVICE_CLASSES)}, "
                                          f"got {service_tiers!r}")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling and what they may do. Limits are None when unlimited."""

    key_id: str
    name: str
    models: tuple[str, ...] | None = None  # served model names this key may use; None: all
    rpm: int | None = None
    tpm: int | None = None
    tpd: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None  # per-request cap on max_tokens
    budget_usd: float | None = None
    expires_at: float | None = None  # unix seconds
    safety: SafetyPolicy | None = None  # the key's own safety policy; None: the model's or the server's
    service_tiers: tuple[ServiceClass, ...] | None = None  # the tiers it may run at; None: the server's default
    # whether its calls may be answered from the response cache: None follows the model's
    # setting; True or False overrides it for this key
    response_cache: bool | None = None

    def __post_init__(self) -> None:
        check_key_fields(self.name, self.models, self.rpm, self.tpm, self.tpd, self.max_concurrent,
                         self.max_tokens, self.budget_usd, self.expires_at)
        check_service_tiers(self.service_tiers)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


ANONYMOUS = Principal(key_id=ANONYMOUS_KEY_ID, name="anonymous")
# The operator, by the server's admin key: reads every key's usage and traces, the models and
# the engine's stats; manages keys. It calls no model (an API key does, under limits and budget).
ADMIN = Principal(key_id="admin", name="admin")


# ---- secrets -------------------------------------------------------------------------------------

def new_key_id() -> str:
    return KEY_ID_PREFIX + secrets.token_hex(NUM_KEY_ID_HEX // 2)


def new_secret(key_id: str) -> str:
    return f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(NUM_SECRET_BYTES)}"


def key_id_of(secret: str) -> str | None:
    """The key_id a well-formed secret names; None for anything else. key_ids hold no '-',
    the random part may."""
    if len(secret) > MAX_SECRET_CHARS or not secret.startswith(SECRET_PREFIX + KEY_ID_PREFIX):
        return None
    key_id, sep, rest = secret[len(SECRET_PREFIX):].partition("-")
    if not sep or len(key_id) != len(KEY_ID_PREFIX) + NUM_KEY_ID_HEX or not rest:
        return None
    return key_id


def hash_secret(secret: str) -> bytes:
    # Plain SHA-256, no slow KDF: a secret carries 256 random bits, so a leaked hash cannot be
    # brute-forced anyway, and a KDF's milliseconds would land on every request.
    return hashlib.sha256(secret.encode()).digest()


def secret_hint(secret: str) -> str:
    """'tw-k_3f9a2c1b-…a9Zq': enough to tell keys apart, useless to an attacker (4 of 43 chars)."""
    key_id = key_id_of(secret)
    assert key_id is not None, "hint of a malformed secret"
    return f"{SECRET_PREFIX}{key_id}-…{secret[-4:]}"


# ---- requests ------------------------------------------------------------------------------------

def secret_from_headers(headers: Mapping[str, str]) -> str | None:
    """The secret from `Authorization: Bearer X` (OpenAI's way) or `x-api-key: X` (Anthropic's).
    `headers` must look names up case-insensitively, as Starlette's Headers do."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = headers.get("x-api-key")
    return api_key.strip() if api_key and api_key.strip() else None


def presents_admin_key(headers: Mapping[str, str], admin_key: str | None) -> bool:
    """Whether the request carries the admin key, as `Authorization: Bearer` or `x-api-key`
    (compared in constant time; with both headers, either may hold it)."""
    if not admin_key:
        return False
    expected = admin_key.encode()
    candidates = [headers.get("x-api-key", "").strip()]
    scheme, _, value = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer":
        candidates.append(value.strip())
    return any(hmac.compare_digest(candidate.encode(), expected) for candidate in candidates if candidate)


def unauthenticated(headers: Mapping[str, str]) -> Principal:
    """Whom a refused 401 is recorded under: the key_id its secret names if the secret is well
    formed (not proof of anything: a guess names one too), else ''."""
    secret = secret_from_headers(headers)
    key_id = key_id_of(secret) if secret is not None else None
    return Principal(key_id=key_id or "", name="unauthenticated")


def principal_for(headers: Mapping[str, str], store: KeyStore | None) -> Principal:
    """The caller of a request; store None means auth is off and everyone is ANONYMOUS."""
    if store is None:
        return ANONYMOUS
    secret = secret_from_headers(headers)
    if secret is None:
        raise AuthenticationError(
            "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
            "(Authorization: Bearer YOUR_KEY) or in an x-api-key header.", code="missing_api_key")
    principal = store.authenticate(secret)
    if principal is None:
        # Nothing of the secret is echoed: a mistyped key is still most of a real one.
        raise AuthenticationError("Incorrect, revoked or expired API key provided.")
    return principal


def authorize_model(principal: Principal, model: str) -> None:
    if not principal.may_use(model):
        raise PermissionDeniedError(f"This API key may not use the model '{truncate(model)}'.",
                                    param="model", code="model_not_allowed")


AUTH_MODES = ("auto", "on", "off")


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only; a host name other than
    localhost is assumed reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    """Whether a call must present a live key: the serve option `auth` and what it depends on.

    auto   on, unless the server binds loopback, no admin key is set and the key store has never
           held a key. Once a key has existed it stays on: a revoked or expired last key leaves
           the server refusing every call, since turning auth off then would open the server at
           the moment its operator shuts a leaked key out (and loopback is where a server sits
           behind a reverse proxy on the same host).
    on     always, even before the first key (every call is a 401 until one exists).
    off    never: the operator's explicit word, whatever the store holds.
    """

    mode: str = "auto"
    host: str = "127.0.0.1"
    has_admin_key: bool = False

    def __post_init__(self) -> None:
        if self.mode not in AUTH_MODES:
            raise FieldError("auth", f"must be one of {', '.join(AUTH_MODES)}, got {self.mode!r}")

    def required(self, has_held_keys: bool) -> bool:
        """has_held_keys: whether the key store holds any key, revoked and expired ones included."""
        if self.mode != "auto":
            return self.mode == "on"
        return has_held_keys or self.has_admin_key or not is_loopback(self.host)

    def reason(self, has_held_keys: bool) -> str:
        """Why auth is on or off, for the startup line and /ready."""
        if self.mode != "auto":
            return f"--auth {self.mode}"
        if has_held_keys:
            return "a key has existed in the key store; only --auth off turns it off"
        if self.has_admin_key:
            return "an admin key is set"
        if not is_loopback(self.host):
            return f"the server binds {self.host}, beyond loopback"
        return "no key has existed and the server binds loopback; the first key turns it on for good"
