"""OpenAI's Responses API without a model: what the official SDK sends parses (every field of
its create call), what the server sends back is the SDK's own types with no key it does not
declare (the Response, every stream event, input items), and a stored conversation reaches the
replica as the chat path's messages. The real app runs in process in front of a scripted
replica (conftest.py) with an in-memory response store."""

from __future__ import annotations

import asyncio
import json
import typing

import httpx
import httpx2
import openai
import pydantic
import pytest
from openai.types.responses import InputTokenCountResponse, Response, ResponseItemList, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from openai.types.responses.tool_param import ToolParam

from tokenway.conversations import open_response_store
from tokenway.observability.observer import Observer
from tokenway.protocol.body import decode_json_body
from tokenway.protocol.errors import BadGatewayError, InvalidRequestError
from tokenway.protocol.job import ChoiceDelta, ToolCallDelta, Usage
from tokenway.protocol.responses import OMITTED_TOOLS, InputTokensRequest, ResponsesRequest
from tokenway.routing.router import Pool, Router
from tokenway.safety.screen import SafetyPolicy
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog, ServerConfig, Services

from .conftest import MODEL, ScriptedReplica, ScriptedServer, sse_events, validate_strictly
from .test_openai_schemas import upstream_logprob

OPENAI_EXTENSIONS = frozenset({"store"})  # sent by OpenAI, not declared by the SDK's Response
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
CALL_ARGUMENTS = '{"city": "Paris"}'
TEXT_EVENTS = [ChoiceDelta(0, text="Hel"), ChoiceDelta(0, text="lo", finish_reason="stop"),
               Usage(prompt_tokens=12, completion_tokens=2, cached_tokens=8)]
CALL_EVENTS = [ChoiceDelta(0, text="Let me look."),
               ChoiceDelta(0, tool_calls=(ToolCallDelta(0, id="call_1", name="get_weather", arguments='{"city": '),)),
               ChoiceDelta(0, tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),), finish_reason="tool_calls"),
               Usage(prompt_tokens=20, completion_tokens=9)]


class ResponsesServer(ScriptedServer):
    """ScriptedServer's app, keeping responses in memory."""

    def __init__(self, safety: SafetyPolicy | None = None, observe: bool = False) -> None:
        self.runner = asyncio.Runner()
        self.replica = ScriptedReplica()
        catalog = ModelCatalog((MODEL,), context_windows={MODEL: 4096})
        router = Router({MODEL: Pool.of(MODEL, [self.replica])})
        self.store = open_response_store("memory")
        settings = ServerConfig(served_model_names=(MODEL,), safety=safety or SafetyPolicy())
        self.app = create_app(Services.build(settings, catalog, router, response_store=self.store,
                                             observer_for=Observer if observe else None))

    def close(self) -> None:
        self.run(self.store.close())
        super().close()

    def create(self, events: list, **body) -> httpx.Response:
        self.replica.events = events
        return self.request("POST", "/v1/responses", {"model": MODEL, **body})

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(api_key="k", base_url="http://t/v1", max_retries=0, _strict_response_validation=True,
                             http_client=httpx2.Client(transport=self.sdk_transport()))


@pytest.fixture()
def responses():
    server = ResponsesServer()
    yield server
    server.close()


def stream_events(text: str) -> list[dict]:
    """The stream's events, each checked: named by its type, the SDK's type, numbered in order."""
    events = []
    for name, data in sse_events(text):
        assert name == data["type"], (name, data)
        events.append(data)
        validate_strictly(ResponseStreamEvent, data, frozenset({"response.store"}))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


# ---- what the SDK sends -------------------------------------------------------------------------

SDK_FIELD_VALUES = {  # a plausible value for every field of the SDK's create call
    "access_programs": {"cyber": "standard"}, "background": False,
    "background_options": {"completion_window": "soonest"}, "context_management": [{"type": "compaction"}],
    "conversation": None, "image": {"context_compression": "auto"}, "include": ["message.output_text.logprobs"],
    "input": "hi", "instructions": "Be brief.", "max_output_tokens": 32, "max_tool_calls": 2,
    "metadata": {"team": "a"}, "model": MODEL, "moderation": {"model": "omni-moderation-latest"},
    "parallel_tool_calls": False, "previous_response_id": None, "prompt": None, "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"}, "safety_identifier": "u1", "service_tier": "auto",
    "store": True, "stream": False, "stream_options": {"include_obfuscation": False}, "temperature": 0.5,
    "text": {"format": {"type": "json_object"}, "verbosity": "low"}, "tool_choice": "auto", "tools": [WEATHER],
    "top_logprobs": 2, "top_p": 0.9, "truncation": "auto", "user": "u1",
}


def test_every_field_of_the_sdks_create_call_is_accepted():
    fields = set(typing.get_type_hints(ResponseCreateParamsBase)) | {"stream"}
    assert fields == set(SDK_FIELD_VALUES), fields ^ set(SDK_FIELD_VALUES)  # a new SDK field needs a value here
    body = ResponsesRequest.model_validate(SDK_FIELD_VALUES)
    assert body.wants_logprobs and body.response_format() == {"type": "json_object"}
    assert body.chat_tools() == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather", "parameters": WEATHER["parameters"], "strict": True}}]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "sandwich"}]}]}, "tools[0].tools[0]",
     "got 'sandwich'"),
    ({"tools": [WEATHER, {"type": "namespace", "name": "n", "tools": [WEATHER]}]}, "tools", "appears twice"),
    ({"tools": [{"type": "sandwich"}]}, "tools[0]", "'function', 'namespace' or one of OpenAI's built-in tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "names tool 'web_search_preview'"),
    # Listed, a built-in tool is left out; forced (by name, or as the only tool), it is refused.
    ({"tools": [WEATHER, {"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice",
     "names tool 'web_search', which this server does not run"),
    ({"tools": [{"type": "custom", "name": "c"}], "tool_choice": {"type": "custom", "name": "c"}}, "tool_choice",
     "names tool 'custom'"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", "not in tools"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0]", "built-in tool"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "text only"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "robot"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"conversation": "conv_1"}, "conversation", "Conversations API"),
    ({"background": True, "store": False}, "background", "store false"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"seed": 3}, "seed", "Unrecognized request argument"),
    ({"temperature": 3}, "temperature", "<= 2"),
])
def test_what_this_server_cannot_do_is_a_400_naming_it(responses, body, param, words):
    body = {"input": "hi", **body}
    response = responses.create(TEXT_EVENTS, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    with pytest.raises(InvalidRequestError):  # the same at the edge, without the app
        decode_json_body(json.dumps({"model": MODEL, **body}).encode(), ResponsesRequest)


# What OpenAI's Codex CLI lists with every request: its functions, a namespace, and the built-in web search.
AGENT_TOOLS = [WEATHER, {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [
    {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}}]},
    {"type": "web_search", "external_web_access": False}, {"type": "image_generation"},
    {"type": "web_search_preview", "search_context_size": "low"}]


@pytest.fixture()
def observed():
    server = ResponsesServer(observe=True)
    yield server
    server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_tools_the_server_cannot_run_are_left_out_and_named(observed, stream):
    responses = observed
    created = responses.create(TEXT_EVENTS, input="hi", tools=AGENT_TOOLS, stream=stream)
    assert created.status_code == 200, created.text
    assert created.headers["x-tokenway-omitted-tools"] == "custom, web_search, image_generation, web_search_preview"
    job = responses.replica.jobs[-1]
    assert [tool["function"]["name"] for tool in job.tools] == ["get_weather", "spawn_agent"]
    assert job.omitted_tools == ("custom", "web_search", "image_generation", "web_search_preview")
    body = stream_events(created.text)[-1]["response"] if stream else created.json()
    assert [tool["type"] for tool in body["tools"]] == ["function", "namespace"]  # what the model was given
    assert [tool["name"] for tool in body["tools"][1]["tools"]] == ["spawn_agent"]
    trace = responses.request("GET", f"/v1/traces/{body['id']}")
    assert trace.status_code == 200, trace.text
    assert trace.json()["omitted_tools"] == list(job.omitted_tools)


def test_every_tool_type_of_the_sdk_is_served_or_left_out():
    """No tool the real API accepts is a 400: a new SDK type needs a decision here."""
    kinds = set()
    for member in typing.get_args(ToolParam):
        hint = typing.get_type_hints(member)["type"]
        kinds |= set(typing.get_args(typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Required
                                     else hint))
    assert kinds - {"function", "namespace"} <= OMITTED_TOOLS, kinds - OMITTED_TOOLS
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "tools": [
        {"type": kind} for kind in sorted(OMITTED_TOOLS)]})
    assert body.chat_tools() is None and set(body.omitted_tools()) == OMITTED_TOOLS


def test_a_call_whose_tools_are_all_left_out_is_a_plain_one(responses):
    created = responses.create(TEXT_EVENTS, input="hi", tools=[{"type": "web_search"}], tool_choice="auto")
    assert created.status_code == 200, created.text
    assert created.headers["x-tokenway-omitted-tools"] == "web_search"
    assert responses.replica.jobs[-1].tools is None and created.json()["tools"] == []
    plain = responses.create(TEXT_EVENTS, input="hi", tools=[WEATHER])
    assert "x-tokenway-omitted-tools" not in plain.headers  # named only where something was left out


def test_items_become_the_chat_paths_messages_and_are_listed_back_with_ids(responses):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "I should call it."}]},
        {"type": "message", "role": "assistant", "id": "msg_a", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "19 C"}]},
    ]
    created = responses.create(TEXT_EVENTS, input=items, instructions="Be brief.", tools=[WEATHER])
    assert created.status_code == 200, created.text
    # The reasoning item stays out of the prompt; the two calls join the assistant's message.
    assert list(responses.replica.jobs[-1].messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "19 C"},
    ]
    response_id = created.json()["id"]
    listed = responses.request("GET", f"/v1/responses/{response_id}/input_items?order=asc&limit=3").json()
    page = validate_strictly(ResponseItemList, listed)
    assert [item.type for item in page.data] == ["message", "message", "reasoning"] and page.has_more
    assert page.data[2].id == "rs_1" and all(item.id for item in page.data)
    rest = responses.request("GET", f"/v1/responses/{response_id}/input_items?order=asc&after={page.last_id}").json()
    assert [item["type"] for item in rest["data"]] == ["message", "function_call", "function_call",
                                                       "function_call_output", "function_call_output"]
    assert rest["has_more"] is False and rest["data"][-1]["output"] == "19 C"
    newest_first = responses.request("GET", f"/v1/responses/{response_id}/input_items").json()
    assert [item["id"] for item in newest_first["data"]] == [item["id"] for item in
                                                              [*listed["data"], *rest["data"]][::-1]]
    assert responses.request("GET", f"/v1/responses/{response_id}/input_items?limit=0").status_code == 400


def test_a_namespaces_functions_are_tools_of_their_own_and_their_calls_name_it(responses):
    namespace = {"type": "namespace", "name": "weather_tools", "description": "Weather.", "tools": [WEATHER]}
    body = responses.create(CALL_EVENTS, input="Weather in Paris?", tools=[namespace]).json()
    assert responses.replica.jobs[-1].tools[0]["function"]["name"] == "get_weather"
    call = body["output"][-1]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "get_weather", "weather_tools")
    assert body["tools"][0]["type"] == "namespace" and body["tools"][0]["tools"][0]["name"] == "get_weather"
    validate_strictly(Response, body, OPENAI_EXTENSIONS)
    passed_back = responses.create(TEXT_EVENTS, tools=[namespace], input=[
        {"role": "user", "content": "Weather in Paris?"}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}])
    assert passed_back.status_code == 200, passed_back.text
    assert responses.replica.jobs[-1].messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"


# ---- what the server sends ----------------------------------------------------------------------


def test_a_response_is_the_sdks_response(responses):
    body = responses.create(TEXT_EVENTS, input="hi", instructions="Be brief.", metadata={"team": "a"}).json()
    response = validate_strictly(Response, body, OPENAI_EXTENSIONS)
    assert (response.status, response.output_text, response.instructions, response.metadata) == (
        "completed", "Hello", "Be brief.", {"team": "a"})
    [message] = response.output
    assert message.id.startswith("msg_") and message.status == "completed" and response.id.startswith("resp_")
    usage = response.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens,
            usage.output_tokens_details.reasoning_tokens, usage.total_tokens) == (12, 8, 2, 0, 14)
    # OpenAI's optional fields go out as null, never left out; a stored response reads back the same.
    assert body["error"] is None and body["incomplete_details"] is None and body["store"] is True
    assert responses.request("GET", f"/v1/responses/{body['id']}").json() == body


def test_a_stream_is_the_sdks_typed_event_sequence(responses):
    events = stream_events(responses.create(CALL_EVENTS, input="Weather in Paris?", tools=[WEATHER], stream=True).text)
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    message, call = events[7]["item"], events[12]["item"]
    assert message["content"][0]["text"] == events[5]["text"] == "Let me look." and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_1", "get_weather", '{"city": "Paris"}', "completed")
    assert events[8]["item"]["status"] == "in_progress" and events[8]["item"]["arguments"] == ""
    final = events[-1]["response"]
    assert final["output"] == [message, call] and final["usage"]["output_tokens"] == 9
    assert {event["response"]["id"] for event in (events[0], events[1], events[-1])} == {final["id"]}
    assert responses.request("GET", f"/v1/responses/{final['id']}").json() == final


def test_a_reply_cut_by_max_output_tokens_is_incomplete(responses):
    cut = [ChoiceDelta(0, text="Once upon", finish_reason="length"), Usage(prompt_tokens=5, completion_tokens=4)]
    body = responses.create(cut, input="A story.", max_output_tokens=4).json()
    assert (body["status"], body["incomplete_details"], body["output"][0]["status"]) == (
        "incomplete", {"reason": "max_output_tokens"}, "incomplete")
    events = stream_events(responses.create(cut, input="A story.", max_output_tokens=4, stream=True).text)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


def test_a_stream_that_fails_ends_with_an_error_event_then_response_failed(responses):
    failure = BadGatewayError("Upstream scripted broke off.")
    events = stream_events(responses.create([ChoiceDelta(0, text="Hi"), failure], input="hi", stream=True).text)
    error, failed = events[-2:]
    assert (error["type"], error["code"], error["message"]) == ("error", failure.code, failure.message)
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": failure.message}
    stored = responses.request("GET", f"/v1/responses/{failed['response']['id']}").json()
    assert stored["status"] == "failed"


def test_the_sdk_creates_streams_and_parses_responses(responses):
    client = responses.sdk()
    responses.replica.events = TEXT_EVENTS
    assert client.responses.create(model=MODEL, input="hi").output_text == "Hello"
    with client.responses.stream(model=MODEL, input="hi") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello"

    class City(pydantic.BaseModel):
        name: str

    responses.replica.events = [ChoiceDelta(0, text='{"name": "Paris"}', finish_reason="stop"),
                             Usage(prompt_tokens=3, completion_tokens=5)]
    parsed = client.responses.parse(model=MODEL, input="Paris as JSON", text_format=City)
    assert parsed.output_parsed == City(name="Paris")
    assert responses.replica.jobs[-1].response_format["json_schema"]["name"] == "City"
    counted = client.responses.input_tokens.count(model=MODEL, input="hi")
    assert validate_strictly(InputTokenCountResponse, counted.model_dump()).input_tokens > 0


def test_previous_response_id_continues_the_stored_conversation(responses):
    client = responses.sdk()
    responses.replica.events = CALL_EVENTS
    first = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Use tools.",
                                    tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    responses.replica.events = TEXT_EVENTS
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "21 C and sunny"}])
    assert second.previous_response_id == first.id and second.output_text == "Hello"
    # The earlier instructions are not carried over, as OpenAI does; the turn and its call are.
    assert list(responses.replica.jobs[-1].messages) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks!")
    roles = [m["role"] for m in responses.replica.jobs[-1].messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]
    # Deleted, it is gone, and so is any continuation of it.
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, previous_response_id=third.id, input="More?")
    assert refused.value.param == "previous_response_id"


def test_store_false_keeps_nothing_and_the_items_passed_back_serve_instead(responses):
    client = responses.sdk()
    responses.replica.events = CALL_EVENTS
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    responses.replica.events = TEXT_EVENTS
    history = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True)
                                                                  for item in first.output]]
    call_id = first.output[-1].call_id
    second = client.responses.create(model=MODEL, store=False, tools=[WEATHER], input=[
        *history, {"type": "function_call_output", "call_id": call_id, "output": "21 C"}])
    assert second.output_text == "Hello"
    assert [m["role"] for m in responses.replica.jobs[-1].messages] == ["user", "assistant", "tool"]


def test_the_sdks_input_tokens_body_is_accepted():
    body = InputTokensRequest.model_validate({"model": MODEL, "input": "hi", "personality": "friendly",
                                              "truncation": "auto", "tools": [WEATHER]})
    assert body.chat_tools() is not None


def test_sampling_fields_reach_the_job_and_logprobs_come_back_when_included(responses):
    logprob_events = [ChoiceDelta(0, text="Hel", logprobs=(upstream_logprob("Hel", -0.1, ("Hi", -2.5)),)),
                      ChoiceDelta(0, text="lo", logprobs=(upstream_logprob("lo", -0.2),), finish_reason="stop"),
                      Usage(prompt_tokens=3, completion_tokens=2)]
    body = {"input": "hi", "temperature": 0.3, "top_p": 0.9, "max_output_tokens": 7, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"]}
    response = responses.create(logprob_events, **body).json()
    params = responses.replica.jobs[-1].params
    assert (params.temperature, params.top_p, params.max_tokens, params.logprobs) == (0.3, 0.9, 7, 1)
    [part] = validate_strictly(Response, response, OPENAI_EXTENSIONS).output[0].content
    assert [(lp.token, [top.token for top in lp.top_logprobs]) for lp in part.logprobs] == [("Hel", ["Hel"]),
                                                                                              ("lo", ["lo"])]
    events = stream_events(responses.create(logprob_events, stream=True, **body).text)
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert [delta["logprobs"][0]["token"] for delta in deltas] == ["Hel", "lo"]
    without = responses.create(logprob_events, input="hi").json()
    assert responses.replica.jobs[-1].params.logprobs is None and without["output"][0]["content"][0]["logprobs"] == []


CARD = "4111 1111 1111 1111"


def test_the_servers_safety_policy_reads_every_item_and_the_reply():
    server = ResponsesServer(SafetyPolicy(input="block", output="redact", categories=frozenset({"credit_card"})))
    try:
        refused = server.create(TEXT_EVENTS, tools=[WEATHER], input=[
            {"role": "user", "content": "Pay for the weather report."},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": f"Charged to {CARD}."}])
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "content_policy_violation"
        assert CARD not in refused.text and server.replica.jobs == []
        leaky = [ChoiceDelta(0, text=f"Your card is {CARD}.", finish_reason="stop"),
                 Usage(prompt_tokens=3, completion_tokens=9)]
        for stream in (False, True):
            answered = server.create(leaky, input="Which card did I use?", stream=stream)
            assert answered.status_code == 200 and CARD not in answered.text and "Your card is" in answered.text
    finally:
        server.close()
