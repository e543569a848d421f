"""The operator's routes:

    GET /engine/stats   the engine's load and every pool's replicas (server/stats.py); an API
                        key sees its models' pools as totals
    GET /health         the process answers
    GET /ready          200 while every served model can be served (the engine alive, a
                        replica of each pool available); 503 + Retry-After otherwise. Its
                        body says whether auth is on, and why (--auth and the key store)
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.gateway.auth import ADMIN, ANONYMOUS
from tokenway.server.routes import call_of
from tokenway.server.services import Services


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.get("/engine/stats")
    async def engine_stats(request: Request) -> dict:
        """A snapshot of the engine: what runs, what waits, how full the KV cache is. Each pool's
        replicas (their names are hosts) for the admin, and for anyone while auth is off; an API
        key sees its models' pools as totals."""
        principal = call_of(request).start.principal
        stats = services.stats()
        if principal is ADMIN or principal is ANONYMOUS:
            return stats.to_dict()
        return stats.with_pool_totals({pool.name for model, pool in services.router.pools.items()
                                       if principal.may_use(model)})

    @api.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> Response:
        engine = services.engine
        engine_alive = engine is None or engine.is_alive
        names = services.catalog.chat_model_names
        if engine_alive and all(services.router.is_servable(n) for n in names):
            body: dict[str, Any] = {"status": "ready", "models": list(names)}
            gatekeeper = services.gatekeeper
            if gatekeeper is not None:
                # A degraded ledger stays ready (200): its database is shared by every gateway, so
                # a 503 here would take them all out of rotation at once, while each can still
                # serve safely (rows journaled and replayed once it is back, budgets counting
                # them meanwhile). The body says so; alert on tokenway_ledger_degraded.
                body["ledger"] = "degraded" if gatekeeper.ledger.health().degraded else "ok"
                # Open to all, as /ready is: whether a call needs a key is no secret to a caller.
                body["auth"] = "on" if gatekeeper.auth_required else "off"
                body["auth_mode"] = gatekeeper.auth.mode
            return JSONResponse(body)
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})

    return api
