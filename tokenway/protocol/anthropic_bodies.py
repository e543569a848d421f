"""What tokenway sends back on /v1/messages and /v1/messages/count_tokens, field for field as
the anthropic SDK's types name them (anthropic/types/message.py, usage.py,
raw_message_stream_event.py, message_tokens_count.py; the beta's context_management); the
requests are protocol/anthropic.py's.

    Generation ─► server/anthropic_render.py ─► Message, or the stream: message_start,
        content_block_start / _delta / _stop ..., message_delta, message_stop
        (a ping after the first block's start; an error event ends a failed stream)

A reply's blocks come in the order the model wrote them: thinking, then text, then tool_use.

TypedDicts, as protocol/openai_bodies.py's and for the same reason: a stream renders one event
per token, and a dict literal pyright checks costs nothing more at run time.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired

from typing_extensions import TypedDict  # pydantic reads only this one before Python 3.12

from tokenway.protocol.errors import AnthropicErrorBody

# pause_turn is not among them: it pauses a turn of server tools, which this server does not run.
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal", "model_context_window_exceeded"]


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


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str  # "" where the call asked for display "omitted"
    signature: str  # server/anthropic_render.py's thinking_signature


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str  # "toolu_..."
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class CacheCreation(TypedDict):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class OutputTokensDetails(TypedDict):
    thinking_tokens: int  # of output_tokens, those spent thinking


class MessageDeltaUsage(TypedDict):
    """The usage message_delta sends, cumulative (the SDK's MessageDeltaUsage). The prompt's
    tokens are split as Anthropic splits them: input_tokens + cache_creation_input_tokens +
    cache_read_input_tokens is the whole prompt."""

    input_tokens: int  # neither read from the cache nor written to it at a breakpoint
    output_tokens: int
    cache_read_input_tokens: int  # served by the prefix cache
    cache_creation_input_tokens: int  # up to the last cache_control breakpoint, not read from the cache
    output_tokens_details: NotRequired[OutputTokensDetails]


# The tier that served a call (gateway/tiers.py anthropic_tier): Anthropic has no flex.
ServedTier = Literal["standard", "priority", "batch"]


class MessageUsage(MessageDeltaUsage):
    """The SDK's Usage."""

    cache_creation: CacheCreation  # cache_creation_input_tokens, under the last breakpoint's ttl
    service_tier: ServedTier
    speed: NotRequired[Literal["standard"]]  # where the call asked for a speed: the one speed here


class RefusalStopDetails(TypedDict):
    type: Literal["refusal"]
    category: None  # the safety policy's categories are not Anthropic's
    explanation: str | None


class ClearToolUsesApplied(TypedDict):
    type: Literal["clear_tool_uses_20250919"]
    cleared_tool_uses: int
    cleared_input_tokens: int


class ClearThinkingApplied(TypedDict):
    type: Literal["clear_thinking_20251015"]
    cleared_thinking_turns: int
    cleared_input_tokens: int


AppliedEdit = ClearToolUsesApplied | ClearThinkingApplied


class ContextManagementResponse(TypedDict):
    """The beta's BetaContextManagementResponse: the edits made to the prompt before the model saw it."""

    applied_edits: list[AppliedEdit]


class Message(TypedDict):
    id: str  # "msg_..."
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None  # None only in message_start
    stop_sequence: str | None
    stop_details: RefusalStopDetails | None  # why a refusal stopped the reply
    usage: MessageUsage
    context_management: NotRequired[ContextManagementResponse]  # where the call asked for context edits


class CountTokensContextManagement(TypedDict):
    original_input_tokens: int  # before the context edits


class MessageTokensCount(TypedDict):
    """POST /v1/messages/count_tokens's answer (the SDK's MessageTokensCount, the beta's with
    context_management)."""

    input_tokens: int
    context_management: NotRequired[CountTokensContextManagement]


# ---- streaming events (each SSE event is named by its type) -------------------------------------


class MessageStartEvent(TypedDict):
    type: Literal["message_start"]
    message: Message  # content [], stop_reason None


class ContentBlockStartEvent(TypedDict):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock  # text "", thinking and signature "", or input {}: the deltas fill them in


class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class InputJSONDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str  # a fragment; the fragments of one block concatenate to its input JSON


class ThinkingDelta(TypedDict):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(TypedDict):
    type: Literal["signature_delta"]
    signature: str  # the block's whole signature, just before its content_block_stop


BlockDelta = TextDelta | InputJSONDelta | ThinkingDelta | SignatureDelta


class ContentBlockDeltaEvent(TypedDict):
    type: Literal["content_block_delta"]
    index: int
    delta: BlockDelta


class ContentBlockStopEvent(TypedDict):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(TypedDict):
    stop_reason: StopReason
    stop_sequence: str | None
    stop_details: RefusalStopDetails | None


class MessageDeltaEvent(TypedDict):
    type: Literal["message_delta"]
    delta: MessageDelta
    usage: MessageDeltaUsage
    context_management: NotRequired[ContextManagementResponse]


class MessageStopEvent(TypedDict):
    type: Literal["message_stop"]


class PingEvent(TypedDict):
    type: Literal["ping"]


StreamEvent = (
    MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
    | MessageDeltaEvent | MessageStopEvent | PingEvent | AnthropicErrorBody
)
