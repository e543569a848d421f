"""A call refused before its first token is answered with a status, streamed or not: the
engine full (503 + Retry-After), a tool no arguments can satisfy (400 naming it). A stream
is never a 200 that carries only an error event, and nothing refused is billed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
NEVER = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}


def post(app, path: str, body: dict, **kwargs) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            response = await client.post(path, json=body, **kwargs)
        await asyncio.sleep(0.05)  # the writer commits
        return response

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path,body,error_type", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
     "service_unavailable"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}, "service_unavailable"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
     "overloaded_error"),
])
def test_a_full_engine_refuses_before_the_first_byte(app_and_ledger, path, body, error_type, stream):
    app, ledger = app_and_ledger
    capacity = app.state.services.capacity
    num_slots = capacity.max_pending_requests
    capacity.take(num_slots)  # every slot held by calls in flight
    try:
        refused = post(app, path, {**body, "stream": stream})
    finally:
        capacity.release(num_slots)
    assert refused.status_code == 503
    assert refused.headers["content-type"].startswith("application/json")  # no event stream began
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == error_type
    assert capacity.num_in_flight == 0
    request_id = refused.headers.get("x-request-id") or refused.headers.get("request-id")
    row = asyncio.run(ledger.get(request_id))
    assert row.status == 503 and row.prompt_tokens == 0 and row.cost_usd == 0
    served = post(app, path, {**body, "stream": stream})  # and the next call is served
    assert served.status_code == 200 and capacity.num_in_flight == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_tool_no_arguments_can_satisfy_is_a_400_naming_it(app_and_ledger, stream):
    app, _ = app_and_ledger
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}, NEVER]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
            "tools": tools, "tool_choice": "required"}
    refused = post(app, "/v1/chat/completions", body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tools[1].function.parameters" and "'f'" in error["message"]
    assert app.state.services.capacity.num_in_flight == 0


def test_tool_parameters_with_pydantic_references_are_served(app_and_ledger):
    app, _ = app_and_ledger
    parameters = {"type": "object", "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                                                       "required": ["name"]}},
                  "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 64,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}],
            "tool_choice": "required", "temperature": 0}
    served = post(app, "/v1/chat/completions", body)
    assert served.status_code == 200, served.text
    choice = served.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    assert isinstance(arguments["city"]["name"], str)  # held to City's schema through its reference
