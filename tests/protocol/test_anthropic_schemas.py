"""Anthropic Messages schemas: what the official SDK sends parses; what the server sends back
(the real app and renderers, in front of a scripted replica), the final Message and every
stream event, is the SDK's own types, validated strictly and with no key the SDK does not
declare; conversion to chat-template messages keeps tool calls intact."""

import json

import anthropic
import httpx2
import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent

from tokenway.protocol.anthropic import MessagesRequest, to_chat_messages, to_chat_tools
from tokenway.protocol.anthropic_bodies import map_stop_reason
from tokenway.protocol.errors import (
    MAX_MESSAGE_CHARS,
    BadGatewayError,
    InvalidRequestError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    anthropic_error_body,
    from_validation_error,
)
from tokenway.protocol.job import ChoiceDelta, ToolCallDelta, Usage
from tokenway.protocol.openai import ChatCompletionRequest

from .conftest import MODEL, sse_events, validate_strictly

WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MESSAGE_BODY = {"max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
# Text, then a tool call in two pieces; 8 of the 20 prompt tokens from the prefix cache.
MESSAGE_EVENTS = [
    ChoiceDelta(0, text="Let me check."),
    ChoiceDelta(0, tool_calls=(ToolCallDelta(0, id="toolu_1", name="get_weather", arguments='{"city": '),)),
    ChoiceDelta(0, tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),), finish_reason="tool_calls"),
    Usage(prompt_tokens=20, completion_tokens=9, cached_tokens=8),
]


def sdk_client(transport: httpx2.BaseTransport) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="http://t", max_retries=0, _strict_response_validation=True,
                               http_client=httpx2.Client(transport=transport))


# ---- what the server sends ----------------------------------------------------------------------


def test_a_message_is_the_sdks_message(scripted):
    body = scripted.answer("/v1/messages", MESSAGE_BODY, MESSAGE_EVENTS).json()
    message = validate_strictly(Message, body)
    text, use = message.content
    assert (text.type, text.text) == ("text", "Let me check.")
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "toolu_1", "get_weather", {"city": "Paris"})
    assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)
    usage = message.usage  # Anthropic counts cached prompt tokens apart from input_tokens
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (12, 8, 9)


def test_a_message_stream_is_the_sdks_events_each_named_by_its_type(scripted):
    response = scripted.answer("/v1/messages", {**MESSAGE_BODY, "stream": True}, MESSAGE_EVENTS)
    events = sse_events(response.text)
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    # The SDK has no type for a ping; Anthropic sends it bare.
    assert events[2][1] == {"type": "ping"}
    start, text_start, text_delta, text_stop, use_start, *pieces, use_stop, delta, stop = [
        validate_strictly(RawMessageStreamEvent, data) for name, data in events if name != "ping"]
    assert (start.message.content, start.message.stop_reason, start.message.usage.output_tokens) == ([], None, 0)
    assert (text_start.index, text_start.content_block.text, text_delta.delta.text) == (0, "", "Let me check.")
    assert (text_stop.index, use_start.index, use_stop.index) == (0, 1, 1)
    assert (use_start.content_block.id, use_start.content_block.input) == ("toolu_1", {})
    assert [piece.delta.partial_json for piece in pieces] == ['{"city": ', '"Paris"}']
    assert (delta.delta.stop_reason, delta.usage.output_tokens, delta.usage.cache_read_input_tokens) == (
        "tool_use", 9, 8)
    assert stop.type == "message_stop"


def test_a_message_stream_that_fails_ends_with_an_anthropic_error_event(scripted):
    failure = BadGatewayError("Upstream scripted broke off.")
    response = scripted.answer("/v1/messages", {**MESSAGE_BODY, "stream": True},
                               [ChoiceDelta(0, text="Hi"), failure])
    name, error = sse_events(response.text)[-1]
    assert name == "error"
    sent = validate_strictly(ErrorResponse, error)
    assert (sent.error.type, sent.error.message) == ("api_error", failure.message)


def test_the_sdk_reads_what_the_server_sends_streamed_or_not(scripted):
    client = sdk_client(scripted.sdk_transport())
    scripted.replica.events = MESSAGE_EVENTS
    message = client.messages.create(model=MODEL, **MESSAGE_BODY)
    with client.messages.stream(model=MODEL, **MESSAGE_BODY) as stream:
        streamed = stream.get_final_message()
    for final in (message, streamed):
        assert final.content[0].text == "Let me check." and final.content[1].input == {"city": "Paris"}
        assert final.stop_reason == "tool_use" and final.usage.output_tokens == 9
    assert streamed.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})


def test_tool_round_trip_through_the_sdk(scripted):
    """A replica's tool call -> the server's Message -> the client sends it back with a
    tool_result -> chat messages whose tool call is the one the replica made."""
    received = []
    client = sdk_client(scripted.sdk_transport(received))
    scripted.replica.events = [
        ChoiceDelta(0, tool_calls=(ToolCallDelta(0, id="toolu_9", name="get_weather", arguments='{"city": "Oslo"}'),),
                    finish_reason="tool_calls"),
        Usage(prompt_tokens=10, completion_tokens=4),
    ]
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.messages.create(model=MODEL, max_tokens=50, messages=history, tools=[WEATHER])
    history += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": [{"type": "text", "text": "-3 C"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]
    client.messages.create(model=MODEL, max_tokens=50, messages=history, tools=[WEATHER], system="Be brief.")
    chat = to_chat_messages(MessagesRequest.model_validate(received[1]))
    assert chat == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "toolu_9", "content": "-3 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    # The same list is a valid OpenAI request and renders identically through it.
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": chat}).template_messages() == chat
    assert scripted.replica.jobs[1].messages == tuple(chat)  # what the replica was asked


# ---- what the SDK sends -------------------------------------------------------------------------


def make_sdk(reply):
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return reply(bodies[-1])

    return sdk_client(httpx2.MockTransport(handler)), bodies


def test_sdk_request_with_every_parameter_parses():
    # Any valid reply: this test checks the request the SDK sent.
    reply = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
             "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
    client, bodies = make_sdk(lambda body: httpx2.Response(200, json=reply))
    client.messages.create(
        model="m", max_tokens=100,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        metadata={"user_id": "u1"}, stop_sequences=["\n\nHuman:"], service_tier="auto",
        thinking={"type": "disabled"}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
    )
    req = MessagesRequest.model_validate(bodies[0])
    assert req.temperature == 0.5 and req.top_k == 40 and req.metadata.user_id == "u1"
    assert to_chat_messages(req) == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Weather in Paris?"}]
    assert to_chat_tools(req) == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Current weather"}}]


@pytest.mark.parametrize(
    "err, sdk_error",
    [(PayloadTooLargeError("too big"), anthropic.RequestTooLargeError),
     (ServiceUnavailableError("busy"), anthropic.InternalServerError),
     (InvalidRequestError("bad", param="x"), anthropic.BadRequestError)],
)
def test_sdk_reads_our_error_bodies(err, sdk_error):
    client, _ = make_sdk(lambda body: httpx2.Response(err.status, json=anthropic_error_body(err)))
    with pytest.raises(sdk_error) as caught:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == err.anthropic_type


@pytest.mark.parametrize(
    "finish_reason, stop_reason, expected",
    [("stop", None, "end_turn"), ("stop", 2, "end_turn"), ("stop", "END", "stop_sequence"),
     ("length", None, "max_tokens"), ("tool_calls", None, "tool_use"), ("content_filter", None, "refusal")],
)
def test_map_stop_reason(finish_reason, stop_reason, expected):
    assert map_stop_reason(finish_reason, stop_reason) == expected


def test_map_stop_reason_rejects_unknown():
    with pytest.raises(ValueError):
        map_stop_reason("abort")


# ---- invalid requests ---------------------------------------------------------------------------

BASE = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
TOOL_USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}


@pytest.mark.parametrize(
    "patch, param, message",
    [
        ({"max_tokens": None}, "max_tokens", "max_tokens: Input should be a valid integer, got None"),
        ({"max_tokens": -1}, "max_tokens", "max_tokens: must be >= 0, got -1"),
        ({"temperature": 1.5}, "temperature", "temperature: must be <= 1.0, got 1.5"),
        ({"messages": []}, "messages", "messages: must have at least 1 item(s)"),
        ({"messages": [{"role": "human", "content": "x"}]}, "messages[0].role", None),
        ({"messages": [{"role": "user", "content": []}]}, "messages",
         "messages: message 0 has empty content: all messages must have non-empty content except for the "
         "optional final assistant message"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                       {"role": "user", "content": "b"}]}, "messages", None),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]",
         "messages[0].content[0]: this model accepts text only; content block type 'image' is not supported"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]},
         "messages[0].content[0].content[0]", None),
        ({"messages": [{"role": "user", "content": [TOOL_USE]}]}, "messages[0].content",
         "messages[0].content: tool_use blocks are not allowed in user messages"),
        ({"tools": [{"name": "f", "input_schema": {"type": 12}}]}, "tools[0].input_schema", None),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
         "tool_choice", "tool_choice: names tool 'g', which is not in tools"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "tool_choice: 'any' needs at least one tool in tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice",
         "tool_choice: type must be one of 'auto', 'any', 'none', 'tool', got 'sometimes'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens",
         "thinking.budget_tokens: must be >= 1024, got 10"),
        ({"max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "max_tokens",
         "max_tokens: must be greater than thinking.budget_tokens (1024), got 1024"),
        ({"thinking": {"type": "sometimes"}}, "thinking",
         "thinking: type must be one of 'enabled', 'disabled', 'adaptive', 'between_tools', got 'sometimes'"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]},
         "messages[0].content[0].source",
         "messages[0].content[0].source: this model accepts text only; document source type 'base64' is not "
         "supported"),
        ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]},
         "messages[0].content", "messages[0].content: thinking blocks are not allowed in user messages"),
        ({"messages": [{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}]},
         "messages[0].content[0].file_id", None),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],  # listed, it is left out; forced:
          "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice", None),
        ({"tools": [{"type": "computer_20250124", "name": "computer", "display_width_px": 1024,
                     "display_height_px": 768}], "tool_choice": {"type": "tool", "name": "computer"}},
         "tool_choice", None),
        ({"tools": [{"type": "bash_20250124", "name": "shell"}]}, "tools[0]",
         "tools[0]: a bash_20250124 tool is named 'bash', got 'shell'"),
        ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]}, "mcp_servers", None),
        ({"thread": {"type": "create"}}, "thread", None),
        ({"compaction": {"type": "summarize"}}, "compaction", None),
        ({"billing_policy": {"type": "billing_policy", "bill_to": "user_profile"}}, "billing_policy", None),
        ({"context_management": {"edits": [{"type": "compact_20260112"}]}}, "context_management.edits[0]", None),
        ({"output_format": {"type": "json_schema", "schema": {"type": "object"}},
          "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_format",
         "output_format: give output_config.format or output_format, not both"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort", None),
        ({"service_tier": "priority"}, "service_tier", None),
        ({"stop_sequences": [""]}, "stop_sequences[0]", None),
        ({"n": 2}, "n", "Unrecognized request argument supplied: n"),
        ({"system": [{"type": "text", "text": "x" * 1_000_000}, {"type": "x" * 1_000_000}]}, "system[1].type", None),
    ],
)
def test_invalid_messages_field(patch, param, message):
    with pytest.raises(pydantic.ValidationError) as caught:
        MessagesRequest.model_validate({**BASE, **patch})
    err = from_validation_error(caught.value)
    assert err.param == param and (message is None or err.message == message)
    assert len(err.message) <= MAX_MESSAGE_CHARS


def test_only_a_last_assistant_message_may_be_empty():
    # It is the prefill the reply goes on from.
    request = MessagesRequest.model_validate(
        {**BASE, "messages": [*BASE["messages"], {"role": "assistant", "content": []}]})
    assert to_chat_messages(request)[-1] == {"role": "assistant", "content": ""}
