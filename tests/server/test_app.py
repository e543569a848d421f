"""The gateway middleware's promises, in process: every answer to a generation call carries
x-request-id and leaves one ledger row (a 413 and a 500 included), non-JSON bodies are 415,
the tokenizer routes sit behind the key, and a server with no key beyond loopback says why."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.protocol.errors import AuthenticationError
from tokenway.server import openai_api

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def call(app, *requests: tuple[str, str, dict]) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            responses = [await client.request(method, path, **kwargs) for method, path, kwargs in requests]
        await asyncio.sleep(0.05)  # the writer commits
        return responses

    return asyncio.run(main())


def row(ledger, request_id: str):
    return asyncio.run(ledger.get(request_id))


def test_a_gateway_bug_is_a_plain_500_with_a_request_id_and_a_ledger_row(app_and_ledger, monkeypatch):
    app, ledger = app_and_ledger

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the gateway")

    monkeypatch.setattr(openai_api, "prepare_chat", broken)
    failed, other = call(app, ("POST", "/v1/chat/completions", {"json": CHAT}),
                         ("POST", "/v1/completions", {"json": {"model": MODEL, "prompt": "hi", "max_tokens": 1}}))
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "internal_error"
    assert "bug" not in failed.text and "Traceback" not in failed.text
    request_id = failed.headers["x-request-id"]
    stored = row(ledger, request_id)
    assert stored.status == 500 and stored.error == "internal server error"
    assert other.status_code == 200  # the server goes on


def test_an_authenticated_413_is_billed_and_traceable(app_and_ledger):
    app, ledger = app_and_ledger
    secret, info = app.state.services.gatekeeper.keys.create(name="big")
    auth = {"Authorization": f"Bearer {secret}"}
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}
    unauthenticated, refused = call(app, ("POST", "/v1/chat/completions", {"json": big}),
                                    ("POST", "/v1/chat/completions", {"json": big, "headers": auth}))
    assert unauthenticated.status_code == 401  # who asks comes first
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "payload_too_large"
    stored = row(ledger, refused.headers["x-request-id"])
    assert (stored.status, stored.key_id) == (413, info.key_id) and "exceeds the limit" in stored.error


def test_a_small_route_has_a_small_body_cap(app_and_ledger):
    app, _ = app_and_ledger
    [response] = call(app, ("POST", "/v1/usage", {"content": b"x" * 100_000,
                                                  "headers": {"content-type": "application/json"}}))
    assert response.status_code == 413 and "65536" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/v1/responses/input_tokens", "/tokenize"])
def test_counting_routes_take_the_generation_body_cap(app_and_ledger, path):
    """Agents count long conversations before sending them: a counting route takes what the
    generation routes take, not the 64 KiB of the other routes."""
    app, _ = app_and_ledger
    long_text = "word " * 30_000  # 150 KB
    body = {"/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": long_text}]},
            "/v1/responses/input_tokens": {"model": MODEL, "input": long_text},
            "/tokenize": {"model": MODEL, "prompt": long_text}}[path]
    [response] = call(app, ("POST", path, {"json": body}))
    assert response.status_code != 413, response.text


@pytest.mark.parametrize("content_type, status", [
    ("application/x-www-form-urlencoded", 415), ("text/plain", 415), ("multipart/form-data; boundary=x", 415),
    ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200),
])
def test_only_json_bodies_start_a_generation(app_and_ledger, content_type, status):
    app, ledger = app_and_ledger
    import json

    [response] = call(app, ("POST", "/v1/chat/completions", {"content": json.dumps(CHAT).encode(),
                                                              "headers": {"content-type": content_type}}))
    assert response.status_code == status, response.text
    if status == 415:
        assert response.json()["error"]["code"] == "unsupported_media_type"
        assert row(ledger, response.headers["x-request-id"]).status == 415


def test_tokenize_and_detokenize_sit_behind_the_key_once_auth_is_on(app_and_ledger):
    app, _ = app_and_ledger
    open_tokenize, open_detokenize = call(app, ("POST", "/tokenize", {"json": {"prompt": "hi"}}),
                                          ("POST", "/detokenize", {"json": {"tokens": [1, 2]}}))
    assert (open_tokenize.status_code, open_detokenize.status_code) == (200, 200)  # auth off: no key yet
    secret, _ = app.state.services.gatekeeper.keys.create(name="t")
    keyless, keyed = call(app, ("POST", "/tokenize", {"json": {"prompt": "hi"}}),
                          ("POST", "/tokenize", {"json": {"prompt": "hi"},
                                                 "headers": {"Authorization": f"Bearer {secret}"}}))
    assert keyless.status_code == 401 and keyed.json()["tokens"] == open_tokenize.json()["tokens"]


def test_tokenize_refuses_what_no_request_could_use(app_and_ledger):
    app, _ = app_and_ledger
    window = app.state.services.catalog.frontend().max_model_len
    huge, over = call(app, ("POST", "/tokenize", {"json": {"prompt": "hello world " * 600_000}}),
                      ("POST", "/tokenize", {"json": {"prompt": "hello world " * (window // 2 + 100)}}))
    assert huge.status_code == over.status_code == 400
    assert huge.json()["error"]["code"] == "context_length_exceeded" and "at least" in huge.json()["error"]["message"]
    assert over.json()["error"]["code"] == "context_length_exceeded"


def test_beyond_loopback_with_no_key_the_401_says_how_to_make_one(app_and_ledger):
    app, _ = app_and_ledger
    gatekeeper: Gatekeeper = app.state.services.gatekeeper
    exposed = Gatekeeper(gatekeeper.keys, gatekeeper.limiter, gatekeeper.ledger, gatekeeper.prices,
                         gatekeeper.defaults, host="0.0.0.0")
    with pytest.raises(AuthenticationError) as info:
        exposed.authenticate({"authorization": "Bearer anything"})
    assert info.value.code == "no_api_keys" and "tokenway keys create" in info.value.message
