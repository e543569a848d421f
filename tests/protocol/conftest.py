"""What the protocol tests share: the real app in process in front of a replica whose answers
each test scripts, so that what the renderers send can be held against the official SDKs'
types; and the check that a body holds no key the SDK does not declare."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import httpx2
import pydantic
import pytest

from tokenway.protocol.job import GenerationJob, ReplicaEvent
from tokenway.routing.router import Pool, Router
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog, ServerConfig, Services

MODEL = "scripted"
T = TypeVar("T")


class ScriptedReplica:
    """Answers every job with `events`, in order; an exception among them is raised there."""

    kind = "openai"
    name = "scripted"

    def __init__(self) -> None:
        self.events: list[ReplicaEvent | Exception] = []
        self.jobs: list[GenerationJob] = []

    async def generate(self, job: GenerationJob) -> AsyncIterator[ReplicaEvent]:
        self.jobs.append(job)
        for event in self.events:
            if isinstance(event, Exception):
                raise event
            yield event

    async def probe(self) -> bool:
        return True

    def stats(self) -> dict:
        return {}

    async def aclose(self) -> None:
        pass


class ScriptedServer:
    """create_app's app with no gatekeeper (no keys) and one untemplated model, MODEL, whose
    replica answers as scripted: the renderers run as in production, without a model. Its
    requests run on one event loop, as a server's do, so work a request leaves running after
    its reply (a stored response's insert) goes on with the next."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.replica = ScriptedReplica()
        catalog = ModelCatalog((MODEL,), context_windows={MODEL: 4096})
        router = Router({MODEL: Pool.of(MODEL, [self.replica])})
        self.app = create_app(Services.build(ServerConfig(served_model_names=(MODEL,)), catalog, router))

    def request(self, method: str, path: str, body: dict | None = None, content: bytes | None = None
                ) -> httpx.Response:
        async def main() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                if content is not None:
                    return await client.request(method, path, content=content,
                                                headers={"content-type": "application/json"})
                return await client.request(method, path, json=body)

        return self.run(main())

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run on the server's loop."""
        return self.runner.run(coroutine)

    def close(self) -> None:
        self.runner.close()

    def sdk_transport(self, received: list[dict] | None = None) -> httpx2.MockTransport:
        """A transport for the official SDKs (built on httpx2) that hands each request to the
        app; each JSON body the SDK sends is appended to `received`."""

        def forward(request: httpx2.Request) -> httpx2.Response:
            if received is not None and request.content:
                received.append(json.loads(request.content))
            response = self.request(request.method, request.url.path, content=request.content or None)
            return httpx2.Response(response.status_code, content=response.content, headers=dict(response.headers))

        return httpx2.MockTransport(forward)

    def answer(self, path: str, body: dict, events: list[ReplicaEvent | Exception]) -> httpx.Response:
        self.replica.events = events
        response = self.request("POST", path, {"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response


@pytest.fixture()
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """A text/event-stream body as (event name, decoded data) pairs; comments are dropped and
    OpenAI's closing `[DONE]` is kept as the string itself."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
        if data:
            payload = "\n".join(data)
            events.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return events


def undeclared_keys(value: Any, path: str = "") -> set[str]:
    """The keys of a validated SDK object that its types do not declare, as dotted paths
    (list positions dropped). The SDKs' models allow extra keys, so validation alone would
    let an invented or misspelled field through."""
    if isinstance(value, pydantic.BaseModel):
        found = {f"{path}{key}" for key in value.model_extra or {}}
        for name in type(value).model_fields:
            found |= undeclared_keys(getattr(value, name), f"{path}{name}.")
        return found
    if isinstance(value, list):
        return set().union(*(undeclared_keys(item, path) for item in value))
    return set()


def validate_strictly(sdk_type: Any, body: Any, extensions: frozenset[str] = frozenset()) -> Any:
    """`body` as the SDK's type (pydantic's strict mode: no coercion), holding no key the SDK
    does not declare beyond `extensions`."""
    value = pydantic.TypeAdapter(sdk_type).validate_python(body, strict=True)
    assert undeclared_keys(value) <= extensions, (undeclared_keys(value) - extensions, body)
    return value
