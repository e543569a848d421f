"""What tokenway sends back on /v1/messages, field for field as the anthropic SDK's types name
them (anthropic/types/message.py, usage.py, raw_message_stream_event.py); the requests are
protocol/anthropic.py's, whose TextBlock and ToolUseBlock are the blocks a caller sends.

    Generation ─► server/anthropic_api.py ─► Message, or the stream: message_start,
        content_block_start / _delta / _stop ..., message_delta, message_stop
        (a ping after the first block's start; an error event ends a failed stream)

TypedDicts, as protocol/openai_bodies.py's and for the same reason: a stream renders one event
per token, and a dict literal pyright checks costs nothing more at run time.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict  # pydantic reads only this one before Python 3.12

from tokenway.protocol.errors import AnthropicErrorBody

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


def map_stop_reason(finish_reason: str, stop_reason: int | str | None = None) -> StopReason:
    """An OpenAI / engine finish_reason as Anthropic's stop_reason. A "stop" caused by a stop
    string (stop_reason is that string) is "stop_sequence"; by end-of-sequence, "end_turn"."""
    if finish_reason == "stop":
        return "stop_sequence" if isinstance(stop_reason, str) else "end_turn"
    reasons: dict[str, StopReason] = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
    if finish_reason not in reasons:
        raise ValueError(f"no Anthropic stop_reason for finish_reason {finish_reason!r}")
    return reasons[finish_reason]


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str  # "toolu_..."
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock


class MessageUsage(TypedDict):
    """The SDK's Usage; message_delta sends it too, cumulative (the SDK's MessageDeltaUsage)."""

    input_tokens: int  # prompt tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class Message(TypedDict):
    id: str  # "msg_..."
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None  # None only in message_start
    stop_sequence: str | None
    usage: MessageUsage


# ---- streaming events (each SSE event is named by its type) -------------------------------------


class MessageStartEvent(TypedDict):
    type: Literal["message_start"]
    message: Message  # content [], stop_reason None


class ContentBlockStartEvent(TypedDict):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock  # text "" or input {}: the deltas fill them in


class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class InputJSONDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str  # a fragment; the fragments of one block concatenate to its input JSON


class ContentBlockDeltaEvent(TypedDict):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | InputJSONDelta


class ContentBlockStopEvent(TypedDict):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(TypedDict):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDeltaEvent(TypedDict):
    type: Literal["message_delta"]
    delta: MessageDelta
    usage: MessageUsage


class MessageStopEvent(TypedDict):
    type: Literal["message_stop"]


class PingEvent(TypedDict):
    type: Literal["ping"]


StreamEvent = (
    MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
    | MessageDeltaEvent | MessageStopEvent | PingEvent | AnthropicErrorBody
)
