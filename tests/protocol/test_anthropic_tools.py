"""Anthropic's server tools (web search, code execution, the toolsets, ...) and the computer
tool, listed beside client tools as agents built on the anthropic SDK list them: left out of
what the model sees and named in the x-tokenway-omitted-tools header and the trace, as the
Responses API leaves out OpenAI's built-in tools; forced through tool_choice, a 400 naming them.
The real app runs in front of a scripted replica (conftest.py)."""

from __future__ import annotations

import typing
from collections.abc import Iterator

import pydantic
import pytest
from anthropic.types.beta.beta_tool_union_param import BetaToolUnionParam
from anthropic.types.tool_union_param import ToolUnionParam

from tokenway.observability.observer import Observer
from tokenway.protocol.anthropic import MessagesRequest, chat_conversation, to_chat_tools
from tokenway.protocol.anthropic_tools import CLIENT_TOOLS, left_out
from tokenway.protocol.errors import MAX_MESSAGE_CHARS, from_validation_error
from tokenway.protocol.job import ChoiceDelta, Usage
from tokenway.routing.router import Pool, Router
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog, ServerConfig, Services

from .conftest import MODEL, ScriptedReplica, ScriptedServer, sse_events

WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
BASE = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
# What an agent on the anthropic SDK lists: its client tools beside Anthropic's server tools.
AGENT_TOOLS = [WEATHER, {"type": "bash_20250124", "name": "bash"},
               {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
               {"type": "code_execution_20250825", "name": "code_execution"},
               {"type": "web_search_20260209", "name": "web_search"},  # a second of one type is named once
               {"type": "mcp_toolset", "mcp_server_name": "docs"},
               {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768}]
LEFT_OUT = ("web_search_20250305", "code_execution_20250825", "web_search_20260209", "mcp_toolset",
            "computer_20250124")
TEXT_EVENTS = [ChoiceDelta(0, text="Hi", finish_reason="stop"), Usage(prompt_tokens=12, completion_tokens=1)]


def sdk_tool_types() -> dict[str, str | None]:
    """Every tool type the anthropic SDK can send (its tool unions, beta too) -> the name the
    type fixes (None: a toolset, which has none)."""
    kinds: dict[str, str | None] = {}

    def literals(hint: typing.Any) -> tuple[str, ...]:
        while typing.get_origin(hint) in (typing.Required, typing.NotRequired):
            hint = typing.get_args(hint)[0]
        return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()

    for union in (ToolUnionParam, BetaToolUnionParam):
        for member in typing.get_args(union):
            hints = typing.get_type_hints(member)
            names = literals(hints.get("name"))
            kinds |= {kind: names[0] if names else None for kind in literals(hints["type"]) if kind != "custom"}
    return kinds


def test_every_tool_type_of_the_sdk_is_served_or_left_out():
    """No tool the real API accepts is a 400: a new SDK type needs a decision here."""
    kinds = sdk_tool_types()
    assert len(kinds) > 20 and "web_search_20250305" in kinds and "mcp_toolset" in kinds
    served = {kind for kind in kinds if kind in CLIENT_TOOLS}
    assert served == set(CLIENT_TOOLS)  # bash, the text editors, memory: function tools, as before
    tools = [WEATHER, *({"type": kind, **({"name": name} if name else {})} for kind, name in kinds.items())]
    body = MessagesRequest.model_validate({**BASE, "tools": tools})
    shown = [tool["function"]["name"] for tool in to_chat_tools(body) or ()]
    assert shown == ["get_weather", *(CLIENT_TOOLS[kind][0] for kind in kinds if kind in CLIENT_TOOLS)]
    assert body.omitted_tools() == tuple(kind for kind in kinds if kind not in CLIENT_TOOLS)
    assert all(left_out(kind) for kind in body.omitted_tools())


def test_client_tools_keep_their_schemas_beside_server_tools():
    body = MessagesRequest.model_validate({**BASE, "tools": AGENT_TOOLS})
    weather, bash = to_chat_tools(body) or ()
    assert weather["function"]["parameters"] == WEATHER["input_schema"]
    assert bash["function"]["name"] == "bash" and "command" in bash["function"]["parameters"]["properties"]
    assert body.omitted_tools() == tuple(dict.fromkeys(LEFT_OUT))


def test_a_call_whose_tools_are_all_left_out_has_none():
    body = MessagesRequest.model_validate({**BASE, "tools": AGENT_TOOLS[2:], "tool_choice": {"type": "auto"}})
    assert to_chat_tools(body) is None and body.omitted_tools() == LEFT_OUT


def test_a_breakpoint_on_a_server_tool_still_ends_the_cached_prefix():
    body = MessagesRequest.model_validate({**BASE, "system": "Be brief.", "tools": [
        {"type": "web_search_20250305", "name": "web_search", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]})
    conversation = chat_conversation(body)
    assert (conversation.num_cached_messages, conversation.cache_ttl) == (1, "1h")


def refusal(patch: dict) -> tuple[str | None, str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        MessagesRequest.model_validate({**BASE, **patch})
    err = from_validation_error(caught.value)
    assert len(err.message) <= MAX_MESSAGE_CHARS
    return err.param, err.message


@pytest.mark.parametrize("choice, message", [
    ({"type": "tool", "name": "web_search"},
     "tool_choice: names tool 'web_search', a web_search_20250305 server tool, which this server leaves out of the "
     "prompt: Anthropic's servers run it and this one does not; define it as a custom tool (name, input_schema) and "
     "run it client-side"),
    ({"type": "tool", "name": "computer", "disable_parallel_tool_use": True},
     "tool_choice: names tool 'computer', a computer_20250124 tool, which this server leaves out of the prompt: it "
     "acts on screenshots, which this text-only model cannot read"),
    ({"type": "tool", "name": "docs"}, "tool_choice: names tool 'docs', which is not in tools"),
])
def test_forcing_a_tool_left_out_is_a_400_naming_it(choice, message):
    assert refusal({"tools": AGENT_TOOLS, "tool_choice": choice}) == ("tool_choice", message)


def test_any_needs_a_tool_the_model_is_shown():
    assert refusal({"tools": AGENT_TOOLS[2:4], "tool_choice": {"type": "any"}}) == (
        "tool_choice", "tool_choice: 'any' needs a client tool in tools; those listed (web_search_20250305, "
        "code_execution_20250825) are left out of the prompt, as tools this server cannot give the model")
    body = MessagesRequest.model_validate({**BASE, "tools": AGENT_TOOLS, "tool_choice": {"type": "any"}})
    assert len(to_chat_tools(body) or ()) == 2


@pytest.mark.parametrize("tool, message", [
    ({"type": "web_serch_20250305", "name": "web_search"}, "type must be 'custom' (or absent), one of "),
    ({"type": 7, "name": "x"}, "type must be a string, got 7"),
])
def test_a_type_no_api_has_is_still_a_400(tool, message):
    param, text = refusal({"tools": [WEATHER, tool]})
    assert param == "tools[1]" and message in text


class ObservedServer(ScriptedServer):
    """ScriptedServer's app with the observer on: its calls leave traces."""

    def __init__(self) -> None:
        super().__init__()
        self.replica = ScriptedReplica()
        catalog = ModelCatalog((MODEL,), context_windows={MODEL: 4096})
        router = Router({MODEL: Pool.of(MODEL, [self.replica])})
        self.app = create_app(Services.build(ServerConfig(served_model_names=(MODEL,)), catalog, router,
                                             observer_for=Observer))


@pytest.fixture()
def observed() -> Iterator[ObservedServer]:
    server = ObservedServer()
    yield server
    server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_server_tools_are_left_out_and_named_in_the_header_and_the_trace(observed, stream):
    response = observed.answer("/v1/messages", {**BASE, "tools": AGENT_TOOLS, "stream": stream}, TEXT_EVENTS)
    assert response.headers["x-tokenway-omitted-tools"] == ", ".join(dict.fromkeys(LEFT_OUT))
    job = observed.replica.jobs[-1]
    assert [tool["function"]["name"] for tool in job.tools] == ["get_weather", "bash"]
    assert job.omitted_tools == LEFT_OUT
    message = sse_events(response.text)[0][1]["message"] if stream else response.json()
    trace = observed.request("GET", f"/v1/traces/{message['id']}")
    assert trace.status_code == 200, trace.text
    assert trace.json()["omitted_tools"] == list(LEFT_OUT)


def test_a_call_without_server_tools_sends_no_header(observed):
    response = observed.answer("/v1/messages", {**BASE, "tools": [WEATHER]}, TEXT_EVENTS)
    assert "x-tokenway-omitted-tools" not in response.headers
    assert observed.replica.jobs[-1].omitted_tools == ()


def test_count_tokens_counts_what_the_model_would_see(observed):
    def count(tools: list[dict]) -> int:
        prompt = {key: value for key, value in BASE.items() if key != "max_tokens"}
        response = observed.request("POST", "/v1/messages/count_tokens", {**prompt, "tools": tools})
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    assert count(AGENT_TOOLS) == count(AGENT_TOOLS[:2]) > count([])
    assert count(AGENT_TOOLS[2:]) == count([])


def test_forcing_a_server_tool_is_an_anthropic_400_at_the_app(observed):
    response = observed.request("POST", "/v1/messages", {
        **BASE, "tools": AGENT_TOOLS, "tool_choice": {"type": "tool", "name": "web_search"}})
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("tool_choice: names tool 'web_search'")
    assert not observed.replica.jobs  # nothing reached the replica
