"""Fuzzing every route of a real server with auth on: hypothesis-made bodies (valid ones with
one field replaced by any JSON, any JSON at all, raw bytes, the wrong Content-Type) and
query strings, plus the categories that once gave 500s (deep nesting, huge integers, lone
surrogates, large bodies). Not one response may be a 5xx."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
ADMIN = "fuzz-admin-secret"

# Text with everything a JSON string can carry, lone surrogates and NUL included.
TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"]), st.just("\x00")), max_size=40)
NUMBERS = st.one_of(st.integers(), st.integers(min_value=-(10**60), max_value=10**60), st.floats(allow_nan=False),
                    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 1e308]))
JSON = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                    max_leaves=12)

MESSAGES = [{"role": "user", "content": "Say hi."}]
BODY_ROUTES = {  # path -> a valid body to mutate
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "Hello"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
    "/admin/keys": {"name": "fuzzed", "rpm": 10},
}
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
          "stop_sequences", "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
          "stream", "stream_options", "min_tokens", "stop_token_ids", "system", "tokens", "messages[0]",
          "messages[0].content", "name", "rpm", "models", "expires_at", "budget_usd", "echo", "metadata"]
GET_ROUTES = ["/v1/models/{text}", "/v1/traces/{text}", "/v1/traces?limit={text}&summary={text}",
              "/v1/usage?key_id={text}&since={text}&until={text}", "/admin/traces/{text}",
              "/admin/traces?limit={text}&summary={text}", "/dashboard/static/{text}",
              "/dashboard/api/snapshot?limit={text}", "/engine/stats", "/metrics", "/v1/models"]
POST_ID_ROUTES = ["/admin/keys/{text}/revoke", "/admin/keys/{text}/rotate"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", None]


def bounded(body):
    """Keep generations short: the fuzzer is after the gateway, not the model's speed."""
    if isinstance(body, dict):
        for key in ("max_tokens", "n", "min_tokens"):
            if type(body.get(key)) is int and body[key] > 4:
                body[key] = 4
    return body


@st.composite
def mutated_body(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["field", "field", "field", "text", "any-json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "any-json":
        return json.dumps(bounded(draw(JSON))).encode()
    body = json.loads(json.dumps(BODY_ROUTES[path]))
    if kind == "text":  # a valid body with any text where the text goes
        text = draw(TEXT)
        for key in ("prompt", "name"):
            if key in body:
                body[key] = text
        if "messages" in body:
            body["messages"][0]["content"] = text
        return json.dumps(body).encode()
    field = draw(st.sampled_from(FIELDS))
    value = draw(JSON)
    if field.startswith("messages[0]") and "messages" in body:
        if field == "messages[0]":
            body["messages"][0] = value
        else:
            body["messages"][0]["content"] = value
    else:
        body[field] = value
    return json.dumps(bounded(body)).encode()


def url_text(text: str) -> str:
    """Percent-encoded, surrogates as the bytes UTF-8 would give them (which are not UTF-8)."""
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


@pytest.fixture(scope="module")
def fuzzed(default_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    key = subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", "create", "--db", str(db), "--name", "fuzz"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()
    server = Server(db=db, env={"TOKENWAY_ADMIN_KEY": ADMIN})
    yield server, key
    assert server.stop() == 0


def test_no_route_answers_5xx_to_anything(fuzzed):
    server, key = fuzzed
    failures: list[tuple] = []
    statuses: dict[str, set[int]] = {}
    client = httpx.Client(base_url=server.base_url, timeout=60)

    def check(method: str, path: str, headers: dict, content: bytes | None = None) -> None:
        response = client.request(method, path, content=content, headers=headers)
        statuses.setdefault(path.split("?")[0] if "{" not in path else path, set()).add(response.status_code)
        if response.status_code >= 500:
            failures.append((method, path, content[:300] if content else None, response.status_code,
                             response.text[:300]))

    def auth_for(path: str) -> dict:
        return {"Authorization": f"Bearer {ADMIN if path.startswith('/admin') else key}"}

    def fuzz_post(path: str) -> None:
        # A function per route, not a loop body: @given allows no default to bind `path` with.
        @settings(max_examples=45, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(body=mutated_body(path), content_type=st.sampled_from(CONTENT_TYPES))
        def post(body, content_type):
            headers = auth_for(path)
            if content_type is not None:
                headers["content-type"] = content_type
            check("POST", path, headers, body)

        post()

    for path in BODY_ROUTES:
        fuzz_post(path)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(route=st.sampled_from(GET_ROUTES + POST_ID_ROUTES), text=TEXT)
    def by_url(route, text):
        path = route.replace("{text}", url_text(text) or "x")
        check("POST" if route in POST_ID_ROUTES else "GET", path, auth_for(path))

    by_url()

    # The categories that were 500s, on every body route.
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    known = [b"[" * 10_000 + b"]" * 10_000, b'{"max_tokens": ' + b"9" * 5000 + b"}",
             b'{"model": "\\ud800", "prompt": "\\udfff", "messages": [{"role": "user", "content": "\\ud800"}]}',
             json.dumps({"model": MODEL, "messages": MESSAGES, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode(),
             json.dumps({"model": MODEL, "prompt": "hello " * 1_200_000, "messages": [
                 {"role": "user", "content": "hello " * 1_200_000}], "tokens": [5] * 1_000_000}).encode()]
    for path in BODY_ROUTES:
        for body in known:
            check("POST", path, {**auth_for(path), "content-type": "application/json"}, body)
    client.close()

    assert not failures, failures[:5]
    # Not vacuous: the fuzz reached every route, and the generation routes did generate.
    assert set(BODY_ROUTES) <= set(statuses)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        assert 200 in statuses[path] and 400 in statuses[path], (path, statuses[path])
    assert 201 in statuses["/admin/keys"] and 415 in statuses["/tokenize"]
    log = server.read_log()
    assert "Traceback" not in log, log[-3000:]
