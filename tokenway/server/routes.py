"""What every API router (the *_api.py modules) shares: the call the gateway middleware opened
for a request, and the OpenAPI entry of a route that parses its own body."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from tokenway.gateway.call import Call


def call_of(request: Request) -> Call:
    """The request's Call (GatewayMiddleware opens it once the caller is known)."""
    return request.scope["state"]["call"]


def schema_extra(model: type) -> dict[str, Any]:
    """An OpenAPI requestBody for a route that parses its own body (so that malformed JSON,
    bad UTF-8 and schema errors all get tokenway's error shape); create_app adds the schemas."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
