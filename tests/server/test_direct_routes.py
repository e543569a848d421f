"""The generation routes' two doors (server/direct_routes.py) answer alike: the same call made
to an app whose GatewayMiddleware calls the endpoints directly and to one that goes through
FastAPI's routing gets the same ASGI messages (status, headers, body, byte for byte but for ids,
times and timings) and writes the same ledger row. The replicas are in-process fakes: what is
compared is the HTTP side, not a model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.observability.observer import Observer
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ReplicaEvent, Usage
from tokenway.routing.router import Pool, Router
from tokenway.server import openai_api
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog, ServerConfig, Services

MODELS = ("stub", "slow")


class StubReplica:
    """An upstream that answers at once ("slow": never, until the call is cancelled)."""

    kind = "openai"

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        if self.name == "slow":
            await asyncio.Event().wait()
        yield ChoiceDelta(0, "Hello", ())
        yield ChoiceDelta(0, " there.", (), finish_reason="stop")
        yield Usage(7, 2)

    async def probe(self) -> bool:
        return True

    def stats(self) -> None:
        return None

    async def aclose(self) -> None:
        pass


@dataclass
class Gateway:
    services: Services
    secrets: dict[str, str] = field(default_factory=dict)  # key name -> secret


def make_gateway(folder, direct: bool) -> tuple[Gateway, FastAPI]:
    folder.mkdir()
    ledger = Ledger(f"sqlite:///{folder / 'ledger.db'}")
    keys = KeyStore(folder / "keys.db")
    gatekeeper = Gatekeeper(keys, InProcessLimiter(), ledger, PriceTable.from_config({}), Defaults(), host="127.0.0.1")
    router = Router({name: Pool.of(name, [StubReplica(name)]) for name in MODELS})
    catalog = ModelCatalog(MODELS, {}, dict.fromkeys(MODELS, 8192))  # untemplated: the replica counts
    services = Services.build(ServerConfig(served_model_names=MODELS), catalog, router, gatekeeper=gatekeeper,
                              observer_for=Observer)
    gateway = Gateway(services, {"user": keys.create(name="user")[0], "once": keys.create(name="once", rpm=1)[0]})
    return gateway, create_app(services, direct_routes=direct)


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes
    key: str | None = "user"  # None: no Authorization; "wrong": a secret of no key
    content_type: str = "application/json"
    calls_before: int = 0  # the same call made first, its answer not compared (a limit to spend)
    disconnect: bool = False  # the client leaves once its body is sent


def chat(**fields) -> bytes:
    return json.dumps({"model": "stub", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "stub", "prompt": "Hi", **fields}).encode()


def messages(**fields) -> bytes:
    return json.dumps({"model": "stub", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
                       **fields}).encode()


CASES = {
    "chat": Case("/v1/chat/completions", chat()),
    "chat streamed": Case("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})),
    "completion": Case("/v1/completions", completion()),
    "completion streamed": Case("/v1/completions", completion(stream=True)),
    "message": Case("/v1/messages", messages()),
    "message streamed": Case("/v1/messages", messages(stream=True)),
    "response": Case("/v1/responses", json.dumps({"model": "stub", "input": "Hi", "store": False}).encode()),
    "embeddings, none served": Case("/v1/embeddings", json.dumps({"model": "stub", "input": "Hi"}).encode()),
    "bad JSON": Case("/v1/chat/completions", b'{"model": "stub", "messages": ['),
    "bad JSON, Anthropic's shape": Case("/v1/messages", b"{"),
    "schema error": Case("/v1/chat/completions", json.dumps({"model": "stub", "messages": "Hi"}).encode()),
    "schema error, Anthropic's shape": Case("/v1/messages", json.dumps({"model": "stub", "messages": []}).encode()),
    "unknown model": Case("/v1/chat/completions", chat(model="nope")),
    "not JSON": Case("/v1/chat/completions", chat(), content_type="text/plain"),
    "no key": Case("/v1/chat/completions", chat(), key=None),
    "wrong key": Case("/v1/messages", messages(), key="wrong"),
    "rate limited": Case("/v1/chat/completions", chat(), key="once", calls_before=1),
    "client gone": Case("/v1/chat/completions", chat(model="slow"), disconnect=True),
    "client gone, streamed": Case("/v1/chat/completions", chat(model="slow", stream=True), disconnect=True),
}


async def exchange(app, gateway: Gateway, case: Case) -> list[dict]:
    """The ASGI messages `app` sends for one call of `case`."""
    headers = [(b"content-type", case.content_type.encode()), (b"content-length", str(len(case.body)).encode())]
    if case.key is not None:
        secret = gateway.secrets.get(case.key, "tw-" + "0" * 40)
        headers.append((b"authorization", f"Bearer {secret}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": case.path, "raw_path": case.path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    request = [{"type": "http.request", "body": case.body, "more_body": False}]
    done = asyncio.Event()

    async def receive() -> dict:
        if request:
            return request.pop()
        if not case.disconnect:
            await done.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    done.set()
    return sent


VOLATILE_HEADERS = {b"x-request-id", b"request-id", b"server-timing", b"retry-after", b"retry-after-ms",
                    b"x-ratelimit-reset-requests", b"x-ratelimit-reset-tokens"}


def normalized(messages: list[dict]) -> list[dict]:
    """The messages with what differs between two runs of one call masked: ids, times, timings."""
    out = []
    for message in messages:
        message = dict(message)
        if "headers" in message:
            message["headers"] = [(name, b"<volatile>" if name in VOLATILE_HEADERS else value)
                                  for name, value in message["headers"]]
        if "body" in message:
            body = re.sub(rb"[0-9a-f]{32}", b"<hex>", message["body"])
            body = re.sub(rb'"(created|completed)(_at)?": ?[0-9.]+', rb'"\1\2": 0', body)
            body = re.sub(rb"server-timing: [^\n]*", b"server-timing: <times>", body)
            message["body"] = re.sub(rb"retry after [0-9.]+ s", b"retry after <n> s", body)
        out.append(message)
    return out


async def ledger_rows(gateway: Gateway) -> list[tuple]:
    """What every ledger row says of its call, once every row is in."""
    gatekeeper = gateway.services.gatekeeper
    assert gatekeeper is not None
    ledger = gatekeeper.ledger
    for _ in range(200):
        if ledger.stats()["num_pending_rows"] == 0:
            break
        await asyncio.sleep(0.01)
    return sorted((row.status, row.error, row.model, row.prompt_tokens, row.completion_tokens, row.finish_reason)
                  for row in await ledger.recent(100))


async def both_doors(tmp_path, case: Case) -> tuple[list[list[dict]], list[list[tuple]]]:
    """(the normalized answers, the ledger rows): the direct door's, then FastAPI's."""
    answers, rows = [], []
    for direct in (True, False):
        gateway, app = make_gateway(tmp_path / f"direct-{direct}", direct)
        try:
            for _ in range(case.calls_before):
                await exchange(app, gateway, case)
            answers.append(normalized(await exchange(app, gateway, case)))
            rows.append(await ledger_rows(gateway))
        finally:
            assert gateway.services.gatekeeper is not None
            await gateway.services.gatekeeper.close()
    return answers, rows


@pytest.mark.parametrize("name", CASES)
def test_both_doors_answer_alike(name, tmp_path):
    answers, rows = asyncio.run(both_doors(tmp_path, CASES[name]))
    assert answers[0] == answers[1]
    assert rows[0] == rows[1]
    assert answers[0][0]["type"] == "http.response.start"
    assert rows[0], "every generation call writes its row"


def test_a_bug_is_the_same_500_through_either_door(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_api, "prepare_chat", broken)
    answers, rows = asyncio.run(both_doors(tmp_path, CASES["chat"]))
    assert answers[0] == answers[1]
    assert rows[0] == rows[1]
    assert answers[0][0]["status"] == 500


def test_the_direct_door_serves_the_generation_routes_only(tmp_path):
    _, app = make_gateway(tmp_path / "app", True)
    stack = app.build_middleware_stack()
    while not hasattr(stack, "direct_routes"):
        stack = stack.app  # type: ignore[attr-defined]  # down the middleware chain to GatewayMiddleware
    assert sorted(stack.direct_routes.path_to_endpoint) == ["/v1/chat/completions", "/v1/completions",
                                                            "/v1/embeddings", "/v1/messages", "/v1/responses"]
