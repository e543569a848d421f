"""POST /v1/messages: the Anthropic Messages API over the same engine and chat path."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from tokenway.frontend.chat import build_chat_prompt
from tokenway.frontend.tools import parse_tool_reply
from tokenway.protocol.anthropic import map_stop_reason, to_chat_messages, to_chat_tools
from tokenway.protocol.errors import anthropic_error_body
from tokenway.routing.job import GenerationJob
from tokenway.server import sse
from tokenway.server.call import Call
from tokenway.server.generation import Generation, framed_stream
from tokenway.server.http import EventStreamResponse
from tokenway.server.serving import (
    ServerState,
    context_window,
    make_sampling_params,
    new_id,
    structured_output_spec,
)


def openai_tools(body) -> tuple[list[dict] | None, object]:
    tools = to_chat_tools(body)
    if not tools:
        return None, "auto"
    choice = body.tool_choice
    kind = getattr(choice, "type", None) if choice is not None else "auto"
    tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        tool_choice = {"type": "function", "function": {"name": choice.name}}
    return tools, tool_choice or "auto"


def prepare(state: ServerState, body, call: Call) -> tuple[Generation, bool]:
    """The adaptor for Messages: the body becomes the same GenerationJob a chat call makes."""
    model = state.route(body, call)
    frontend = state.frontend(model)
    tools, tool_choice = openai_tools(body)
    messages = to_chat_messages(body)
    with context_window(frontend, "messages") as window:
        prompt = build_chat_prompt(frontend.tokenizer, messages, tools, tool_choice, max_num_tokens=window)
    max_tokens = state.max_tokens(call, frontend, len(prompt.prompt_token_ids), body.max_tokens, "max_tokens",
                                  num_messages=len(body.messages))
    fields = SimpleNamespace(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=None,
                             presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None)
    params = make_sampling_params(fields, max_tokens, structured_output_spec(prompt.json_schema, False), None,
                                  body.stop_sequences)
    job = GenerationJob(new_id("msg_"), model, "chat", params, messages=tuple(messages),
                        tools=tuple(tools) if tools else None, tool_choice=tool_choice,
                        prompt_token_ids=tuple(prompt.prompt_token_ids), stream=bool(body.stream))
    return Generation(state, call, job), prompt.generic_tools


def content_blocks(text: str, generic_tools: bool) -> tuple[list[dict], bool]:
    if generic_tools:
        content, calls = parse_tool_reply(text)
        if calls:
            return [{"type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name,
                     "input": json.loads(c.arguments)} for c in calls], True
        text = content or ""
    return [{"type": "text", "text": text}], False


def stop_fields(completion, used_tools: bool) -> tuple[str, str | None]:
    if used_tools:
        return "tool_use", None
    stop_sequence = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    if completion.finish_reason == "abort":
        return "end_turn", None
    return map_stop_reason(completion.finish_reason, stop_sequence), stop_sequence


def usage(generation: Generation, output_tokens: int | None = None) -> dict:
    # Anthropic counts cached prompt tokens apart: input_tokens are the uncached ones.
    usage = generation.usage()
    return {"input_tokens": usage["prompt_tokens"] - generation.num_cached_tokens,
            "output_tokens": usage["completion_tokens"] if output_tokens is None else output_tokens,
            "cache_read_input_tokens": generation.num_cached_tokens, "cache_creation_input_tokens": 0}


async def message_response(generation: Generation, generic_tools: bool) -> dict:
    final = (await generation.final_outputs())[0]
    blocks, used_tools = content_blocks(final.text, generic_tools)
    stop_reason, stop_sequence = stop_fields(final, used_tools)
    return {"id": generation.request_id, "type": "message", "role": "assistant", "content": blocks,
            "model": generation.model, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(generation)}


def message_stream(generation: Generation, generic_tools: bool) -> AsyncIterator[bytes]:
    """Anthropic's framing: an error is an `event: error`; success ends with message_stop."""
    return framed_stream(message_events(generation, generic_tools), generation,
                         lambda exc: [sse.named_event("error", anthropic_error_body(exc))],
                         [sse.named_event("message_stop", {"type": "message_stop"})])


async def message_events(generation: Generation, generic_tools: bool) -> AsyncIterator[bytes]:
    yield sse.named_event("message_start", {"type": "message_start", "message": {
        "id": generation.request_id, "type": "message", "role": "assistant", "content": [],
        "model": generation.model, "stop_reason": None, "stop_sequence": None, "usage": usage(generation, 0)}})
    block_open = False
    async for delta in generation.outputs():
        if not generic_tools:
            if not block_open:
                block_open = True
                yield sse.named_event("content_block_start", {
                    "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
                yield sse.named_event("ping", {"type": "ping"})
            if delta.text:
                yield sse.named_event("content_block_delta", {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": delta.text}})
        if delta.finish_reason is None:
            continue
        used_tools = False
        if generic_tools:
            # One JSON reply: parsed, and sent as blocks, once it is complete.
            blocks, used_tools = content_blocks(generation.text(delta.index), True)
            for index, block in enumerate(blocks):
                if block["type"] == "text":
                    start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
                else:
                    start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield sse.named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                              "content_block": start})
                yield sse.named_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                              "delta": delta})
                yield sse.named_event("content_block_stop", {"type": "content_block_stop", "index": index})
        else:
            yield sse.named_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        stop_reason, stop_sequence = stop_fields(delta, used_tools)
        yield sse.named_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": generation.num_completion_tokens}})


async def handle(state: ServerState, request: Request, body, call: Call) -> Response:
    generation, generic_tools = await state.prepare(request, prepare, state, body, call)
    await state.admit(call)
    if body.stream:
        return EventStreamResponse(message_stream(generation, generic_tools))
    return await generation.json_response(request, message_response(generation, generic_tools), "request-id")
