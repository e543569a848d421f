"""POST /v1/moderations: OpenAI's moderations shape over the safety stage's detectors, under the
server's policy (safety/moderations.py)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenway.safety.moderations import ModerationRequest, moderation_response
from tokenway.server.http import parse_body
from tokenway.server.routes import schema_extra
from tokenway.server.services import Services


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/moderations", openapi_extra=schema_extra(ModerationRequest))
    async def moderations(request: Request) -> Response:
        body = await parse_body(request, ModerationRequest, services.body_parser)
        return JSONResponse(moderation_response(services.settings.safety, body.texts()))

    return api
