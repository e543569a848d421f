"""The generation routes' second door: GatewayMiddleware hands a POST on one of them straight to
the endpoint its router registered, below FastAPI's routing.

    GatewayMiddleware ─┬─► DirectRoutes (POST /v1/chat/completions, ...) ─► the router's endpoint
                       └─► FastAPI: ExceptionMiddleware ─► AsyncExitStack ─► Router ─► the route
                           (every other request)

A generation call is the hot path of a gateway, and FastAPI's layers for it (the exception
middleware, the exit stacks, matching the path against every route, solving an endpoint's
dependencies when it has none but the Request) cost about as much event-loop time as tokenway's
own auth, admission and ledger row together. The endpoints are the routers' own, taken from the
app's routes (one set of handlers, two doors), and an exception is answered by the app's own
handlers, found as Starlette finds them: FastAPI keeps every route, and both doors answer alike,
byte for byte.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute, APIRouter
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class DirectRoutes:
    """path -> the endpoint of its POST route, for the routes whose endpoint takes the Request
    alone (a route with dependencies or parameters stays FastAPI's); `exception_handlers`: the
    app's own (a live view: a handler added later is found too)."""

    path_to_endpoint: Mapping[str, Endpoint]
    exception_handlers: Mapping[Any, Callable[..., Any]]

    @classmethod
    def of(cls, app: FastAPI, routers: Iterable[APIRouter], paths: Iterable[str]) -> DirectRoutes:
        """The POST routes on `paths` of `routers`, which `app` includes as they are (no prefix,
        no dependencies); the first router to declare a path is the one FastAPI matches too."""
        wanted = set(paths)
        path_to_endpoint: dict[str, Endpoint] = {}
        for router in routers:
            for route in router.routes:
                if isinstance(route, APIRoute) and route.path in wanted and route.path not in path_to_endpoint \
                        and "POST" in (route.methods or ()) and takes_the_request_alone(route):
                    path_to_endpoint[route.path] = route.endpoint
        return cls(path_to_endpoint, app.exception_handlers)

    def endpoint(self, path: str) -> Endpoint | None:
        """The endpoint a POST on `path` goes to directly; None: FastAPI routes it."""
        return self.path_to_endpoint.get(path)

    async def __call__(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the endpoint and send its response, as FastAPI's route would: an exception one
        of the app's handlers takes is answered by it (a RuntimeError once the response has
        started, as Starlette raises); any other goes on up to GatewayMiddleware."""
        request = Request(scope, receive, send)
        response_started = False

        async def sender(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            response = await endpoint(request)
            await response(scope, receive, sender)
        except Exception as exc:
            handler = self.handler_for(exc)
            if handler is None:
                raise
            if response_started:
                raise RuntimeError("Caught handled exception, but response already started.") from exc
            response = await handler(request, exc)
            if response is not None:
                await response(scope, receive, sender)
            exc.__traceback__ = None  # an exception instance reused across calls must not gather frames

    def handler_for(self, exc: Exception) -> Callable[..., Any] | None:
        """The app's handler for `exc` below the server-error boundary (Exception and 500 are
        ServerErrorMiddleware's, outside GatewayMiddleware): by status for an HTTPException,
        else by the nearest class in its MRO."""
        handlers = self.exception_handlers
        if isinstance(exc, HTTPException) and exc.status_code != 500:
            handler = handlers.get(exc.status_code)
            if handler is not None:
                return handler
        for cls in type(exc).__mro__:
            if cls is Exception:
                return None
            handler = handlers.get(cls)
            if handler is not None:
                return handler
        return None


def takes_the_request_alone(route: APIRoute) -> bool:
    """An async endpoint of one parameter, the Request, and no dependencies: what FastAPI would
    call it with is known without solving anything."""
    if route.dependencies or route.dependant.dependencies or not inspect.iscoroutinefunction(route.endpoint):
        return False
    parameters = list(inspect.signature(route.endpoint, eval_str=True).parameters.values())
    return len(parameters) == 1 and parameters[0].annotation is Request
