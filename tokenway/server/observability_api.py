"""The observability HTTP surface.

    GET /metrics                          Prometheus exposition (open, as vLLM's is: scrape it from a trusted network)
    GET /v1/traces/{request_id}           the caller's own trace: the ring, else the ledger (the admin key: any)
    GET /v1/traces?limit=N[&summary=true] the caller's recent traces, or the 'where the time went' table
                                          (the admin key: everyone's)
    GET /admin/traces/{request_id}        any trace (admin key)
    GET /admin/traces?limit=N[&summary=true]
    GET /dashboard                        the web page (static files, nothing built at run time)
    GET /dashboard/api/snapshot?limit=N   what the page draws; the admin key when auth is on
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Query
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from tokenway.gateway.auth import ADMIN
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.observability.observer import Observer
from tokenway.observability.traces import Trace, summarize
from tokenway.protocol.errors import AuthenticationError, NotFoundError
from tokenway.server.admin_api import check_admin_key
from tokenway.server.routes import call_of
from tokenway.server.services import Services

DASHBOARD_DIR = Path(__file__).parents[1] / "observability" / "dashboard"  # package data of observability/
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".html": "text/html; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
MAX_LIMIT = 2048


def router(services: Services) -> APIRouter:
    """The routes above, where the server observes (none under --no-observability)."""
    if services.observer is None:
        return APIRouter()
    return observability_router(services.observer, services.gatekeeper, services.settings.admin_key)


def observability_router(observer: Observer, gatekeeper: Gatekeeper | None, admin_key: str | None) -> APIRouter:
    """gatekeeper: whose ledger holds the traces the observer's ring no longer does, and whose
    auth decides whether the dashboard's data needs the admin key (None: no ledger, no auth)."""
    router = APIRouter(include_in_schema=False)

    async def find(request_id: str) -> Trace | None:
        trace = observer.traces.get(request_id)
        if trace is None and gatekeeper is not None:
            row = await gatekeeper.ledger.get(request_id)
            trace = None if row is None else Trace.from_usage_record(row)
        return trace

    async def recent(limit: int, key_id: str | None) -> list[Trace]:
        traces = observer.traces.recent(MAX_LIMIT if key_id is not None else limit)
        if key_id is not None:
            traces = [t for t in traces if t.key_id == key_id][:limit]
        return traces

    def listing(traces: list[Trace], summary: bool) -> dict:
        if summary:
            return {"object": "trace_summary", **summarize(traces)}
        return {"object": "list", "data": [trace_body(t) for t in traces]}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        # With --workers N, any worker answers for the host; ?scope=process is one worker's own.
        own_only = request.query_params.get("scope") == "process"
        return Response(await observer.metrics.host_exposition(own_only), media_type=CONTENT_TYPE_LATEST,
                        headers={"x-tokenway-worker": observer.metrics.worker_label} if own_only else None)

    @router.get("/v1/traces/{request_id}")
    async def own_trace(request: Request, request_id: str) -> dict:
        principal = call_of(request).start.principal
        trace = await find(request_id)
        # Another key's trace does not exist for this one.
        if trace is None or (trace.key_id != principal.key_id and principal is not ADMIN):
            raise NotFoundError(f"No trace for request '{request_id[:64]}' (traces of other keys are not shown)",
                                param="request_id", code="trace_not_found")
        return trace_body(trace)

    @router.get("/v1/traces")
    async def own_traces(request: Request, limit: int = Query(100, ge=1, le=MAX_LIMIT),
                         summary: bool = False) -> dict:
        principal = call_of(request).start.principal
        return listing(await recent(limit, None if principal is ADMIN else principal.key_id), summary)

    @router.get("/admin/traces/{request_id}")
    async def any_trace(request: Request, request_id: str) -> dict:
        check_admin_key(request, admin_key)
        trace = await find(request_id)
        if trace is None:
            raise NotFoundError(f"No trace for request '{request_id[:64]}'", param="request_id",
                                code="trace_not_found")
        return trace_body(trace)

    @router.get("/admin/traces")
    async def all_traces(request: Request, limit: int = Query(100, ge=1, le=MAX_LIMIT), summary: bool = False) -> dict:
        check_admin_key(request, admin_key)
        return listing(await recent(limit, None), summary)

    @router.get("/dashboard")
    async def dashboard() -> Response:
        return FileResponse(DASHBOARD_DIR / "index.html", media_type=STATIC_TYPES[".html"],
                            headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}")
    async def dashboard_file(name: str) -> Response:
        path = DASHBOARD_DIR / name
        # Only files directly in the dashboard folder ({name} cannot hold a "/"; ".." is refused).
        if name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
            raise NotFoundError(f"No dashboard file '{name[:64]}'")
        return FileResponse(path, media_type=STATIC_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/api/snapshot")
    async def snapshot(request: Request, limit: int = Query(50, ge=1, le=500)) -> JSONResponse:
        if gatekeeper is not None and gatekeeper.auth_required:
            if admin_key is None:
                raise AuthenticationError("Auth is on and this server has no admin key: start it with --admin-key "
                                          "to use the dashboard.", code="invalid_admin_key")
            check_admin_key(request, admin_key)
        return JSONResponse(observer.snapshot(limit), headers={"Cache-Control": "no-store"})

    return router


def trace_body(trace: Trace) -> dict:
    return {"object": "trace", **trace.to_dict()}
