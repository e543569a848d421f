"""The worker's app in process on the session's fp32 engine: what a gateway sees when the
engine fails inside a call or is down, and the error shape of what is not a route
(tests/routing/test_worker.py drives a real `tokenway worker`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tokenway.engine.client import AsyncEngine
from tokenway.server.worker_api import create_worker_app

SECRET = "worker-secret-for-the-tests-0123"
AUTH = {"authorization": f"Bearer {SECRET}"}


@pytest.fixture()
def local_app(llm, default_model_dir):
    engine = AsyncEngine(core=llm.engine)
    yield engine, create_worker_app(engine, "local", SECRET, model_dir=default_model_dir, block_size=16)
    engine.shutdown()


def request(app, method: str, path: str, **options) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=60) as client:
            return await client.request(method, path, **options)

    return asyncio.run(main())


def post_generate(app, body: dict) -> httpx.Response:
    return request(app, "POST", "/worker/v1/generate", json=body, headers=AUTH)


def test_an_engine_failure_mid_call_is_an_error_event_and_a_dead_engine_a_503(local_app, llm, monkeypatch):
    engine, app = local_app
    body = {"request_id": "f", "prompt_token_ids": llm.tokenizer.encode("hi"), "params": {"max_tokens": 3}}

    def failing(out, interjection=None):
        raise RuntimeError("simulated device failure")

    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "execute", failing)
        response = post_generate(app, body)
    assert response.status_code == 200
    # Nothing of the call ran: 503, so a gateway may still run it elsewhere; no [DONE].
    assert response.text.strip().splitlines()[-1] == (
        'data: {"error":{"message":"The worker\'s engine failed while generating this request.",'
        '"type":"service_unavailable","code":503}}')

    engine.shutdown()
    dead = post_generate(app, body)
    assert dead.status_code == 503 and dead.headers["retry-after"] == "1"
    assert dead.json()["error"]["code"] == "engine_unavailable"


def test_what_is_not_a_route_answers_in_the_error_shape(local_app):
    _, app = local_app
    missing = request(app, "GET", "/worker/v1/nothing-here", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    wrong_method = request(app, "GET", "/worker/v1/generate", headers=AUTH)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert request(app, "GET", "/worker/v1/nothing-here").status_code == 401  # the secret comes first
