"""Anthropic Messages schemas: what the official SDK sends parses; our Message and stream events
parse (strictly) in the SDK; conversion to chat-template messages keeps tool calls intact."""

import json

import anthropic
import httpx2
import pydantic
import pytest

from tokenway.protocol.anthropic import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    PingEvent,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    map_stop_reason,
    to_chat_messages,
    to_chat_tools,
    to_content_blocks,
)
from tokenway.protocol.errors import (
    MAX_MESSAGE_CHARS,
    InvalidRequestError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    anthropic_error_body,
    from_validation_error,
)
from tokenway.protocol.openai import ChatCompletionRequest

WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USAGE = MessageUsage(input_tokens=5, output_tokens=7, cache_read_input_tokens=8, cache_creation_input_tokens=0)


def make_sdk(reply):
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return reply(bodies[-1])

    client = anthropic.Anthropic(api_key="k", base_url="http://t", max_retries=0, _strict_response_validation=True,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    return client, bodies


def message(content, stop_reason="end_turn", stop_sequence=None) -> Message:
    return Message(id="msg_1", content=content, model="m", stop_reason=stop_reason, stop_sequence=stop_sequence,
                   usage=USAGE)


def test_sdk_request_parses_and_message_parses_back():
    reply = message(to_content_blocks("Let me check.", [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]), stop_reason="tool_use")
    client, bodies = make_sdk(lambda body: httpx2.Response(200, json=reply.model_dump(mode="json")))
    result = client.messages.create(
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
    assert result.stop_reason == "tool_use" and result.usage.cache_read_input_tokens == 8
    assert result.content[0].text == "Let me check." and result.content[1].input == {"city": "Paris"}


def test_sdk_stream_assembles_our_events():
    start = message([], stop_reason=None).model_copy(update={"usage": MessageUsage(input_tokens=5, output_tokens=1)})
    events = [
        MessageStartEvent(message=start),
        ContentBlockStartEvent(index=0, content_block=TextBlock(text="")),
        PingEvent(),
        ContentBlockDeltaEvent(index=0, delta=TextDelta(text="Hel")),
        ContentBlockDeltaEvent(index=0, delta=TextDelta(text="lo")),
        ContentBlockStopEvent(index=0),
        ContentBlockStartEvent(index=1, content_block=ToolUseBlock(id="toolu_1", name="get_weather", input={})),
        ContentBlockDeltaEvent(index=1, delta=InputJSONDelta(partial_json='{"city": ')),
        ContentBlockDeltaEvent(index=1, delta=InputJSONDelta(partial_json='"Paris"}')),
        ContentBlockStopEvent(index=1),
        MessageDeltaEvent(delta=MessageDelta(stop_reason="tool_use"), usage=MessageDeltaUsage(output_tokens=9)),
        MessageStopEvent(),
    ]
    sse = "".join(f"event: {e.type}\ndata: {e.model_dump_json()}\n\n" for e in events)
    client, _ = make_sdk(lambda body: httpx2.Response(200, content=sse.encode(),
                                                      headers={"content-type": "text/event-stream"}))
    with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "x"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "Hello" and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 9


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


def test_tool_round_trip_through_the_sdk():
    """Engine tool call -> Message -> the client sends it back with a tool_result -> chat messages
    whose tool call is the one the engine made."""
    call = {"id": "toolu_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    reply = message(to_content_blocks(None, [call]), stop_reason=map_stop_reason("tool_calls"))
    client, bodies = make_sdk(lambda body: httpx2.Response(200, json=reply.model_dump(mode="json")))
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.messages.create(model="m", max_tokens=50, messages=history, tools=[WEATHER])
    history += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": [{"type": "text", "text": "-3 C"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]
    client.messages.create(model="m", max_tokens=50, messages=history, tools=[WEATHER], system="Be brief.")
    chat = to_chat_messages(MessagesRequest.model_validate(bodies[1]))
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
        ({"max_tokens": 0}, "max_tokens", "max_tokens: must be >= 1, got 0"),
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
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking",
         "thinking: extended thinking is not supported by this server"),
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
