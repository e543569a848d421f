"""Fuzzing /v1/responses and a stored response's routes on a real server with auth on:
hypothesis-made bodies (a valid body with one field, an item or a part replaced by any JSON;
any JSON; raw bytes; the wrong Content-Type) and ids and query strings. Not one answer may be
a 5xx, and the server's log holds no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import REPO, Server
from .test_fuzz import CONTENT_TYPES, JSON, TEXT, url_text

MODEL = "smollm2-135m-instruct"
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ITEMS = [{"role": "user", "content": "Weather in Paris?"},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}]
BODIES = {  # path -> a valid body to mutate
    "/v1/responses": {"model": MODEL, "input": ITEMS, "tools": [TOOL], "max_output_tokens": 2},
    "/v1/responses/input_tokens": {"model": MODEL, "input": ITEMS, "tools": [TOOL]},
}
FIELDS = ["model", "input", "instructions", "previous_response_id", "store", "background", "stream", "tools",
          "tool_choice", "parallel_tool_calls", "text", "max_output_tokens", "temperature", "top_p", "top_logprobs",
          "metadata", "truncation", "include", "reasoning", "stream_options", "prompt", "conversation", "user",
          "input[0]", "input[1]", "input[2]", "input[0].content", "input[0].role", "input[1].arguments",
          "input[2].output", "tools[0]", "tools[0].parameters", "text.format"]
ID_ROUTES = [("GET", "/v1/responses/{text}"), ("DELETE", "/v1/responses/{text}"),
             ("POST", "/v1/responses/{text}/cancel"), ("GET", "/v1/responses/{text}/input_items"),
             ("GET", "/v1/responses/{id}?stream={text}&include={text}"),
             ("GET", "/v1/responses/{id}/input_items?limit={text}&order={text}&after={text}")]


def put(body: dict, field: str, value) -> None:
    """body with `field` ("input[1].arguments", "text.format") set to `value`."""
    *path, last = field.replace("[", ".").replace("]", "").split(".")
    target = body
    for part in path:
        target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
    if last.isdigit():
        target[int(last)] = value
    else:
        target[last] = value


@st.composite
def mutated_body(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["field", "field", "field", "field", "any-json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    body = json.loads(json.dumps(BODIES[path]))
    if kind == "any-json":
        body = draw(JSON)
    else:
        put(body, draw(st.sampled_from(FIELDS)), draw(st.one_of(JSON, TEXT)))
    if isinstance(body, dict):
        if type(body.get("max_output_tokens")) is int and body["max_output_tokens"] > 4:
            body["max_output_tokens"] = 4  # after the gateway, not the model's speed
        if path == "/v1/responses" and "max_output_tokens" not in body:
            body["max_output_tokens"] = 4
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def fuzzed(default_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("responses-fuzz") / "fuzz.db"
    key = subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", "create", "--db", str(db), "--name", "fuzz"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()
    server = Server(db=db)
    yield server, key
    assert server.stop() == 0


def test_no_responses_route_answers_5xx_to_anything(fuzzed):
    server, key = fuzzed
    auth = {"Authorization": f"Bearer {key}"}
    client = httpx.Client(base_url=server.base_url, timeout=60)
    stored = client.post("/v1/responses", headers=auth, json={**BODIES["/v1/responses"], "max_output_tokens": 2})
    assert stored.status_code == 200, stored.text
    stored_id = stored.json()["id"]
    failures: list[tuple] = []
    statuses: dict[str, set[int]] = {}

    def check(method: str, path: str, headers: dict, content: bytes | None = None) -> None:
        response = client.request(method, path, content=content, headers=headers)
        statuses.setdefault(f"{method} {path.split('?')[0]}", set()).add(response.status_code)
        if response.status_code >= 500:
            failures.append((method, path, content[:300] if content else None, response.status_code,
                             response.text[:300]))

    def fuzz_post(path: str) -> None:
        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(body=mutated_body(path), content_type=st.sampled_from(CONTENT_TYPES))
        def post(body, content_type):
            headers = dict(auth)
            if content_type is not None:
                headers["content-type"] = content_type
            check("POST", path, headers, body)

        post()

    for path in BODIES:
        fuzz_post(path)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(route=st.sampled_from(ID_ROUTES), text=TEXT)
    def by_url(route, text):
        method, template = route
        check(method, template.replace("{id}", stored_id).replace("{text}", url_text(text) or "x"), auth)

    by_url()
    # A continuation of the stored response with a fuzzed input: the chain is read, then the input checked.
    for value in ([], [{}], [{"type": "message"}], "", [{"role": "user", "content": [{"type": "input_text"}]}]):
        check("POST", "/v1/responses", {**auth, "content-type": "application/json"}, json.dumps(
            {"model": MODEL, "previous_response_id": stored_id, "input": value, "max_output_tokens": 2}).encode())
    client.close()

    assert not failures, failures[:5]
    # Not vacuous: both bodies were fuzzed, and the fuzz reached generation as well as refusals.
    assert 200 in statuses["POST /v1/responses"] and 400 in statuses["POST /v1/responses"], statuses
    assert {200, 400, 415} <= statuses["POST /v1/responses/input_tokens"], statuses
    log = server.read_log()
    assert "Traceback" not in log, log[-3000:]
