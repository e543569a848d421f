"""A Messages call's reply, rendered: a Message, or Anthropic's named SSE events (an error is
an `event: error`; success ends with message_stop). The blocks come as the model wrote them:
its thinking (a thinking block), its text, its tool calls (tool_use blocks).

A thinking block's signature is thinking_signature(its thinking): tokenway cannot make
Anthropic's (an encrypted copy of the thinking that only Anthropic reads back), and needs none:
a thinking block sent back is passed to the template as the turn's reasoning, checked against
nothing, since a caller writes whatever it likes into its own prompt anyway. The digest is
there for clients that keep only signed blocks, and tells a block tokenway made from another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from tokenway.gateway.tiers import anthropic_tier
from tokenway.protocol.anthropic_bodies import (
    BlockDelta,
    ContentBlock,
    Message,
    MessageDeltaUsage,
    MessageUsage,
    RefusalStopDetails,
    StopReason,
    StreamEvent,
    ThinkingBlock,
    map_stop_reason,
)
from tokenway.protocol.errors import anthropic_error_body
from tokenway.protocol.job import ChoiceDelta, ToolCallDelta
from tokenway.server import sse
from tokenway.server.anthropic_prepare import MessagesCall
from tokenway.server.generation import ChoiceResult, Generation, framed_stream

SIGNATURE_PREFIX = "tokenway-sha256:"


def thinking_signature(thinking: str) -> str:
    return SIGNATURE_PREFIX + hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


def thinking_block(thinking: str, shown: bool) -> ThinkingBlock:
    return {"type": "thinking", "thinking": thinking if shown else "", "signature": thinking_signature(thinking)}


def content_blocks(result: ChoiceResult, call: MessagesCall) -> list[ContentBlock]:
    """The reply's content blocks: its thinking, its text, then its tool calls; a prewarm's none."""
    if call.prewarm:
        return []
    blocks: list[ContentBlock] = [thinking_block(result.reasoning, call.thinking_shown)] if result.reasoning else []
    uses: list[ContentBlock] = [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input}
                                for c in result.tool_calls if (tool_input := tool_input_of(c.arguments)) is not None]
    if result.text or not (blocks or uses):
        blocks.append({"type": "text", "text": result.text})
    return blocks + uses


def tool_input_of(arguments: str) -> dict[str, Any] | None:
    """A tool call's arguments as Anthropic's `input` object; None for arguments that are no
    JSON object (a call cut short), which are dropped."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def stop_fields(completion: ChoiceResult | ChoiceDelta, call: MessagesCall) -> tuple[StopReason, str | None]:
    """stop_reason and stop_sequence of a finished choice; an abort (the caller's own stop, a
    drained replica) ended the turn."""
    finish_reason = completion.finish_reason
    if finish_reason is None or finish_reason == "abort":
        return "end_turn", None
    if call.prewarm:
        return "max_tokens", None
    if finish_reason == "length" and call.window_bound:
        return "model_context_window_exceeded", None
    stop_sequence = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return map_stop_reason(finish_reason, stop_sequence), stop_sequence


def stop_details(generation: Generation, stop_reason: StopReason) -> RefusalStopDetails | None:
    if stop_reason != "refusal":
        return None
    categories = generation.safety_output().get("safety_output") or ()
    return {"type": "refusal", "category": None, "explanation": "The reply was stopped by this server's content "
            f"policy{': it contained ' + ', '.join(categories) if categories else ''}."}


def delta_usage(generation: Generation, call: MessagesCall, output_tokens: int | None = None) -> MessageDeltaUsage:
    """The prompt's tokens as Anthropic splits them: those the prefix cache served; those up to
    the last cache_control breakpoint it did not (written to it, as a breakpoint asks); the rest."""
    usage = generation.usage()
    num_prompt_tokens, num_read = usage["prompt_tokens"], generation.num_cached_tokens
    num_created = max(0, min(call.num_breakpoint_tokens, num_prompt_tokens) - num_read)
    counted: MessageDeltaUsage = {
        "input_tokens": num_prompt_tokens - num_read - num_created,
        "output_tokens": usage["completion_tokens"] if output_tokens is None else output_tokens,
        "cache_read_input_tokens": num_read, "cache_creation_input_tokens": num_created}
    if output_tokens is None and generation.num_reasoning_tokens:
        counted["output_tokens_details"] = {"thinking_tokens": generation.num_reasoning_tokens}
    return counted


def message_usage(generation: Generation, call: MessagesCall, output_tokens: int | None = None) -> MessageUsage:
    counted = delta_usage(generation, call, output_tokens)
    num_created = counted["cache_creation_input_tokens"]
    usage: MessageUsage = {**counted, "service_tier": anthropic_tier(generation.job.service_class), "cache_creation": {
        "ephemeral_5m_input_tokens": num_created if call.cache_ttl == "5m" else 0,
        "ephemeral_1h_input_tokens": num_created if call.cache_ttl == "1h" else 0}}
    if call.speed_asked:
        usage["speed"] = "standard"
    return usage


async def message_response(generation: Generation, call: MessagesCall) -> Message:
    final = (await generation.final_outputs())[0]
    stop_reason, stop_sequence = stop_fields(final, call)
    message: Message = {
        "id": generation.request_id, "type": "message", "role": "assistant", "content": content_blocks(final, call),
        "model": generation.model, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "stop_details": stop_details(generation, stop_reason), "usage": message_usage(generation, call)}
    if call.applied_edits is not None:
        message["context_management"] = {"applied_edits": call.applied_edits}
    return message


def event(payload: StreamEvent) -> bytes:
    """One stream event, its SSE name its type."""
    return sse.named_event(payload["type"], payload)


def message_stream(generation: Generation, call: MessagesCall) -> AsyncIterator[bytes]:
    """Anthropic's framing: an error is an `event: error`; success ends with message_stop."""
    return framed_stream(message_events(generation, call), generation,
                         lambda exc: [event(anthropic_error_body(exc))], [event({"type": "message_stop"})])


async def message_events(generation: Generation, call: MessagesCall) -> AsyncIterator[bytes]:
    yield event({"type": "message_start", "message": {
        "id": generation.request_id, "type": "message", "role": "assistant", "content": [],
        "model": generation.model, "stop_reason": None, "stop_sequence": None, "stop_details": None,
        "usage": message_usage(generation, call, 0)}})
    blocks = BlockWriter(call.thinking_shown)
    stop: tuple[StopReason, str | None] | None = None
    async for delta in generation.outputs():
        if not call.prewarm:
            for block_event in blocks.write(delta):
                yield block_event
        if delta.finish_reason is None:
            continue
        for block_event in blocks.close(empty_text=not call.prewarm):
            yield block_event
        stop = stop_fields(delta, call)
    if stop is not None:  # after the replica's usage, which follows its last delta
        delta_event: Any = {"type": "message_delta", "usage": delta_usage(generation, call), "delta": {
            "stop_reason": stop[0], "stop_sequence": stop[1], "stop_details": stop_details(generation, stop[0])}}
        if call.applied_edits is not None:
            delta_event["context_management"] = {"applied_edits": call.applied_edits}
        yield event(delta_event)


class BlockWriter:
    """Anthropic's content blocks as a reply's pieces arrive: thinking opens a thinking block
    (its signature_delta closes it), text a text block, a tool call's first piece (id and name)
    a tool_use block, whose arguments follow as input_json_delta fragments; a new block closes
    the open one. A ping follows the first block's start, as Anthropic sends it."""

    def __init__(self, thinking_shown: bool = True) -> None:
        self.thinking_shown = thinking_shown
        self.num_blocks = 0
        self.open: Literal["text", "thinking", "tool_use"] | None = None  # the open block's type
        self.thinking: list[str] = []  # the open thinking block's text

    def write(self, delta: ChoiceDelta) -> list[bytes]:
        events = self.thinking_text(delta.reasoning) if delta.reasoning else []
        if delta.text:
            events += self.text(delta.text)
        for piece in delta.tool_calls:
            events += self.tool_call(piece)
        return events

    def _start(self, block: ContentBlock) -> list[bytes]:
        events = self.close()
        events.append(event({"type": "content_block_start", "index": self.num_blocks, "content_block": block}))
        if self.num_blocks == 0:
            events.append(event({"type": "ping"}))
        self.open = block["type"]
        return events

    def _delta(self, delta: BlockDelta) -> bytes:
        return event({"type": "content_block_delta", "index": self.num_blocks, "delta": delta})

    def thinking_text(self, text: str) -> list[bytes]:
        events = self._start({"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
        self.thinking.append(text)
        if self.thinking_shown:
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return events

    def text(self, text: str) -> list[bytes]:
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def tool_call(self, piece: ToolCallDelta) -> list[bytes]:
        events: list[bytes] = []
        if piece.id is not None or self.open != "tool_use":
            events = self._start({"type": "tool_use", "id": piece.id or "", "name": piece.name or "", "input": {}})
        if piece.arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return events

    def close(self, empty_text: bool = False) -> list[bytes]:
        """Stop the open block; with empty_text, a reply that opened none gets an empty text block."""
        if self.open is None:
            if empty_text and self.num_blocks == 0:
                return self._start({"type": "text", "text": ""}) + self.close()
            return []
        events = []
        if self.open == "thinking":
            signature = thinking_signature("".join(self.thinking))
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
            self.thinking = []
        self.open = None
        self.num_blocks += 1
        return [*events, event({"type": "content_block_stop", "index": self.num_blocks - 1})]
