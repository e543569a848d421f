"""POST /v1/messages: the Anthropic Messages API over the same engine and chat path. The
adaptor (prepare_messages) makes the same PreparedCall a chat call does; the reply renders as
a Message, or as Anthropic's named SSE events (an error is an `event: error`; success ends
with message_stop)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tokenway.gateway.call import Call
from tokenway.protocol.anthropic import MessagesRequest, ToolChoiceTool, to_chat_messages, to_chat_tools
from tokenway.protocol.anthropic_bodies import (
    ContentBlock,
    InputJSONDelta,
    Message,
    MessageUsage,
    StopReason,
    StreamEvent,
    TextDelta,
    map_stop_reason,
)
from tokenway.protocol.errors import anthropic_error_body
from tokenway.protocol.job import ChoiceDelta, GenerationJob, ToolCallDelta
from tokenway.protocol.sampling import SamplingParams
from tokenway.safety.channels import ChatInput, screen_chat
from tokenway.server import sse
from tokenway.server.generation import ChoiceResult, Generation, admitted, framed_stream
from tokenway.server.http import EventStreamResponse, offload, parse_body
from tokenway.server.prepare import PreparedCall, chat_prompt, field_errors, new_id, prepared, route, screen
from tokenway.server.routes import call_of, schema_extra
from tokenway.server.services import Services


def router(services: Services) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages", openapi_extra=schema_extra(MessagesRequest))
    async def messages(request: Request) -> Response:
        body = await parse_body(request, MessagesRequest, services.body_parser)
        call = call_of(request)
        prepared_call = await offload(request, services.body_parser.inline_bytes, prepare_messages, services, body,
                                      call)
        generation = await admitted(services, call, prepared_call)
        if body.stream:
            await generation.start_stream(request)  # a refusal is a status, not a 200 stream of one error
            return EventStreamResponse(message_stream(generation), on_close=generation.aclose)
        return await generation.json_response(request, message_response(generation), "request-id")

    return api


def openai_tools(body: MessagesRequest) -> tuple[list[dict] | None, str | dict]:
    tools = to_chat_tools(body)
    if not tools:
        return None, "auto"
    choice = body.tool_choice
    kind = getattr(choice, "type", None) if choice is not None else "auto"
    tool_choice: str | dict | None = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
    if isinstance(choice, ToolChoiceTool):
        tool_choice = {"type": "function", "function": {"name": choice.name}}
    return tools, tool_choice or "auto"


def prepare_messages(services: Services, body: MessagesRequest, call: Call) -> PreparedCall:
    """The adaptor for Messages: the body becomes the same GenerationJob a chat call makes."""
    model = route(services, call, body.model)
    policy = services.safety_policy(model, call.start.principal)
    tools, tool_choice = openai_tools(body)
    chat = screen_chat(partial(screen, call, policy), ChatInput(to_chat_messages(body), tools))
    parallel = False if getattr(body.tool_choice, "disable_parallel_tool_use", None) else None
    # A last assistant message is Anthropic's prefill: the reply goes on from it.
    templating = chat_prompt(services, call, model, chat, tool_choice, body.max_tokens, "max_tokens",
                             len(body.messages), parallel,
                             continue_final_message=chat.messages[-1]["role"] == "assistant")
    with field_errors():
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            max_tokens=templating.max_tokens, stop=tuple(s for s in (body.stop_sequences or ()) if s),
            structured_output=templating.structured, skip_special_tokens=templating.skip_special_tokens)
    job = GenerationJob(new_id("msg_"), model, "chat", params, messages=templating.messages,
                        tools=tuple(chat.tools) if chat.tools else None, tool_choice=tool_choice,
                        parallel_tool_calls=parallel is None, prompt_token_ids=templating.prompt_token_ids,
                        context_window=templating.context_window, stream=bool(body.stream))
    reply_format = templating.reply_format and dataclasses.replace(templating.reply_format, id_prefix="toolu_")
    return prepared(services, call, job, services.catalog.frontend(model), policy, reply_format)


def content_blocks(result: ChoiceResult) -> list[ContentBlock]:
    """The reply's content blocks: its text, then its tool calls."""
    uses: list[ContentBlock] = [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input}
                                for c in result.tool_calls if (tool_input := tool_input_of(c.arguments)) is not None]
    if result.text or not uses:
        return [{"type": "text", "text": result.text}, *uses]
    return uses


def tool_input_of(arguments: str) -> dict[str, Any] | None:
    """A tool call's arguments as Anthropic's `input` object; None for arguments that are no
    JSON object (a call cut short), which are dropped."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def stop_fields(completion: ChoiceResult | ChoiceDelta) -> tuple[StopReason, str | None]:
    """stop_reason and stop_sequence of a finished choice; an abort (the caller's own stop, a
    drained replica) ended the turn."""
    finish_reason = completion.finish_reason
    if finish_reason is None or finish_reason == "abort":
        return "end_turn", None
    stop_sequence = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return map_stop_reason(finish_reason, stop_sequence), stop_sequence


def usage(generation: Generation, output_tokens: int | None = None) -> MessageUsage:
    # Anthropic counts cached prompt tokens apart: input_tokens are the uncached ones.
    usage = generation.usage()
    return {"input_tokens": usage["prompt_tokens"] - generation.num_cached_tokens,
            "output_tokens": usage["completion_tokens"] if output_tokens is None else output_tokens,
            "cache_read_input_tokens": generation.num_cached_tokens, "cache_creation_input_tokens": 0}


async def message_response(generation: Generation) -> Message:
    final = (await generation.final_outputs())[0]
    stop_reason, stop_sequence = stop_fields(final)
    return {"id": generation.request_id, "type": "message", "role": "assistant", "content": content_blocks(final),
            "model": generation.model, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(generation)}


def event(payload: StreamEvent) -> bytes:
    """One stream event, its SSE name its type."""
    return sse.named_event(payload["type"], payload)


def message_stream(generation: Generation) -> AsyncIterator[bytes]:
    """Anthropic's framing: an error is an `event: error`; success ends with message_stop."""
    return framed_stream(message_events(generation), generation, lambda exc: [event(anthropic_error_body(exc))],
                         [event({"type": "message_stop"})])


async def message_events(generation: Generation) -> AsyncIterator[bytes]:
    yield event({"type": "message_start", "message": {
        "id": generation.request_id, "type": "message", "role": "assistant", "content": [],
        "model": generation.model, "stop_reason": None, "stop_sequence": None, "usage": usage(generation, 0)}})
    blocks = BlockWriter()
    stop: tuple[StopReason, str | None] | None = None
    async for delta in generation.outputs():
        if delta.text:
            for block_event in blocks.text(delta.text):
                yield block_event
        for piece in delta.tool_calls:
            for block_event in blocks.tool_call(piece):
                yield block_event
        if delta.finish_reason is None:
            continue
        for block_event in blocks.close(empty_text=True):
            yield block_event
        stop = stop_fields(delta)
    if stop is not None:  # after the replica's usage, which follows its last delta
        yield event({"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                     "usage": usage(generation)})


class BlockWriter:
    """Anthropic's content blocks as a reply's pieces arrive: text opens a text block, a tool
    call's first piece (id and name) a tool_use block, whose arguments follow as input_json_delta
    fragments; a new block closes the open one. A ping follows the first block's start, as
    Anthropic sends it."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.open: Literal["text", "tool_use"] | None = None  # the open block's type

    def _start(self, block: ContentBlock) -> list[bytes]:
        events = self.close()
        events.append(event({"type": "content_block_start", "index": self.num_blocks, "content_block": block}))
        if self.num_blocks == 0:
            events.append(event({"type": "ping"}))
        self.open = block["type"]
        return events

    def _delta(self, delta: TextDelta | InputJSONDelta) -> bytes:
        return event({"type": "content_block_delta", "index": self.num_blocks, "delta": delta})

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
        self.open = None
        self.num_blocks += 1
        return [event({"type": "content_block_stop", "index": self.num_blocks - 1})]
