"""The admin HTTP API for API keys, guarded by the admin key from the config, and the usage
the ledger holds.

    POST /admin/keys                   {"name", "models"?, "rpm"?, ...} -> 201 {"key": <secret, shown once>, ...info}
                                       ("service_tiers"?: the tiers its calls may run at;
                                        "response_cache"?: true/false overrides the models' cache setting)
    GET  /admin/keys                   -> {"object": "list", "data": [info, ...]}     (never a secret)
    POST /admin/keys/{key_id}/revoke   -> info (revoking twice is not an error)
    POST /admin/keys/{key_id}/rotate   -> {"key": <new secret>, ...info}
                                       (503 + Retry-After while the key store's database is unreachable)
    GET  /v1/usage[?key_id&since&until] the caller's usage by day, model and tier (the admin key: anyone's)

Every /admin route needs `Authorization: Bearer <admin_key>` (401 otherwise). With no admin key
configured the whole /admin API answers 404, as if it did not exist. A server without a
gatekeeper (no keys, no ledger) has none of these routes.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeAlias, TypeVar

import pydantic
from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from tokenway.billing.ledger import LedgerUnavailable
from tokenway.gateway.auth import ADMIN, MAX_NAME_CHARS
from tokenway.gateway.keystore import KeyStore, KeyStoreUnavailable, UnknownKeyError
from tokenway.protocol.errors import (
    AuthenticationError,
    FieldError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
    truncate,
)
from tokenway.protocol.job import ServiceClass
from tokenway.safety.detectors import CATEGORIES
from tokenway.safety.screen import MODES, SafetyPolicy
from tokenway.server.body_parser import BodyParser
from tokenway.server.http import parse_body
from tokenway.server.routes import call_of
from tokenway.server.services import Services

PositiveInt = Annotated[int, pydantic.Field(ge=1)]
T = TypeVar("T")


# Built from the safety stage's own names (one owner for them), which pydantic reads at run time.
Mode: TypeAlias = Literal[MODES]  # pyright: ignore[reportInvalidTypeForm]
Category: TypeAlias = Literal[CATEGORIES]  # pyright: ignore[reportInvalidTypeForm]


class SafetyBody(pydantic.BaseModel):
    """A key's own safety policy (safety/screen.py), in place of the model's or the server's."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    input: Mode = "off"
    output: Mode = "off"
    categories: Annotated[list[Category], pydantic.Field(min_length=1)] | None = None
    threshold: Annotated[float, pydantic.Field(gt=0, le=1, allow_inf_nan=False)] = 0.5


class CreateKeyRequest(pydantic.BaseModel):
    # strict: "60" or true is not a limit; extra=forbid: a misspelt "rpm_limit" must not
    # silently create an unlimited key.
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, pydantic.Field(min_length=1, max_length=MAX_NAME_CHARS)]
    models: Annotated[list[Annotated[str, pydantic.Field(min_length=1)]], pydantic.Field(min_length=1)] | None = None
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    tpd: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    budget_usd: Annotated[float, pydantic.Field(ge=0, allow_inf_nan=False)] | None = None
    expires_at: Annotated[float, pydantic.Field(allow_inf_nan=False)] | None = None  # unix seconds
    safety: SafetyBody | None = None
    # The tiers the key's calls may run at (gateway/tiers.py); None: the server's default grant.
    service_tiers: Annotated[list[ServiceClass], pydantic.Field(min_length=1)] | None = None
    # Whether its calls may be answered from the response cache; None: as each model's config says.
    response_cache: bool | None = None


def check_admin_key(request: Request, admin_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <admin_key>`; 404 when the
    server has no admin key (the admin API does not exist then)."""
    if admin_key is None:
        raise NotFoundError(f"No route {request.method} {request.url.path}")
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    # compare_digest: the time taken must not reveal how much of the admin key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), admin_key.encode()):
        raise AuthenticationError("This route needs the admin key: Authorization: Bearer ADMIN_KEY.",
                                  code="invalid_admin_key")


def router(services: Services) -> APIRouter:
    """The admin API and /v1/usage, where the server has a gatekeeper (keys and a ledger)."""
    api = APIRouter()
    gatekeeper = services.gatekeeper
    if gatekeeper is None:
        return api
    api.include_router(admin_router(gatekeeper.keys, services.settings.admin_key))
    ledger = gatekeeper.ledger

    @api.get("/v1/usage")
    async def usage(request: Request, key_id: str | None = None, since: float | None = None,
                    until: float | None = None) -> dict:
        """The caller's usage by day, model and service tier; the admin key's: every key's, or the key_id named."""
        principal = call_of(request).start.principal
        if key_id is None:
            key_id = None if principal is ADMIN else principal.key_id
        elif key_id != principal.key_id and principal is not ADMIN:
            raise PermissionDeniedError("Only the admin key may read another key's usage.", param="key_id")
        try:
            rows = await ledger.usage(key_id, since, until)
        except LedgerUnavailable as exc:
            raise ServiceUnavailableError("Usage cannot be read while the ledger's database is unreachable; "
                                          "calls are still recorded.", retry_after=exc.retry_after_s,
                                          code="ledger_unavailable") from exc
        return {"object": "list", "data": rows}

    return api


def admin_router(store: KeyStore, admin_key: str | None) -> APIRouter:
    if admin_key is not None and not admin_key.strip():
        raise ValueError("admin_key: must be a non-empty string, or None to disable the admin API")

    def require_admin(request: Request) -> None:
        check_admin_key(request, admin_key)

    router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], include_in_schema=False)
    parser = BodyParser()  # admin bodies are small (the gateway caps them): parsed where they arrive

    async def call(method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """In the thread pool: a write may wait on SQLite's lock (the ledger shares the file) or on
        PostgreSQL, and the event loop must not wait with it."""
        try:
            return await run_in_threadpool(method, *args, **kwargs)
        except KeyStoreUnavailable as exc:
            raise ServiceUnavailableError("API keys cannot be managed while the key store's database is "
                                          "unreachable; calls with existing keys are still served.",
                                          retry_after=exc.retry_after_s, code="key_store_unavailable") from exc

    @router.post("/keys")
    async def create_key(request: Request) -> JSONResponse:
        body = await parse_body(request, CreateKeyRequest, parser)
        try:
            fields = body.model_dump()
            if body.safety is not None:
                fields["safety"] = SafetyPolicy.from_dict(fields["safety"])
            secret, info = await call(store.create, **fields)
        except ValueError as exc:  # e.g. expires_at in the past (a FieldError naming it)
            param = exc.param if isinstance(exc, FieldError) else None
            known = param in CreateKeyRequest.model_fields
            raise InvalidRequestError(str(exc), param=param if known else None) from None
        return JSONResponse({"key": secret, **info.to_dict()}, status_code=201)

    @router.get("/keys")
    async def list_keys() -> dict[str, Any]:
        infos = await call(store.list)
        return {"object": "list", "data": [info.to_dict() for info in infos]}

    @router.post("/keys/{key_id}/revoke")
    async def revoke_key(key_id: str) -> dict[str, Any]:
        await call(store.revoke, key_id)
        info = await call(store.get, key_id)
        if info is None:
            raise _unknown_key(key_id)
        return info.to_dict()

    @router.post("/keys/{key_id}/rotate")
    async def rotate_key(key_id: str) -> dict[str, Any]:
        try:
            secret = await call(store.rotate, key_id)
        except UnknownKeyError:
            raise _unknown_key(key_id) from None
        except ValueError as exc:  # revoked
            raise InvalidRequestError(str(exc)) from None
        info = await call(store.get, key_id)
        assert info is not None
        return {"key": secret, **info.to_dict()}

    return router


def _unknown_key(key_id: str) -> NotFoundError:
    return NotFoundError(f"No API key {truncate(key_id)!r}.", code="key_not_found")
