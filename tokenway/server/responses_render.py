"""OpenAI's Responses shapes for a Generation: the Response object, and the typed event stream.

    response_base(body, prepared)          the Response as created: every echoed field, no output
    OutputItems.feed(delta) ... .close()   the reply's output items as its deltas arrive (and, for
                                           a stream, the events each delta makes): responses_output.py
    finished / failed(base, items, ...)    the Response at its end
    response_json / response_stream        one JSON body, or the SSE events framed the OpenAI way

A stream goes: response.created, response.in_progress, then per output item
output_item.added, [content_part.added, reasoning_text.delta ..., reasoning_text.done,
content_part.done | content_part.added, output_text.delta ..., output_text.done,
content_part.done | function_call_arguments.delta ..., function_call_arguments.done],
output_item.done; and response.completed (response.incomplete where max_output_tokens or the
safety stage cut it). Every event is named (`event: <type>`) and numbered (sequence_number, from
0). An error after the stream began is an `error` event, then response.failed. Usage is the chat
path's (Generation.usage), renamed; tool calls are its parsed pieces (ToolCallDelta). A
reasoning model's thinking (ChoiceDelta.reasoning) is a reasoning item of its own, before the
message or calls it led to, its text one reasoning_text part, as OpenAI's SDK types raw
reasoning (vLLM sends gpt-oss's so); no summary parts (a summary would take another call).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from tokenway.gateway.tiers import openai_tier
from tokenway.protocol.errors import InternalServerError, TokenwayError
from tokenway.protocol.responses import (
    AllowedToolsChoice,
    FunctionChoice,
    FunctionTool,
    NamespaceTool,
    OmittedTool,
    ResponsesRequest,
    TextFormatJSONSchema,
)
from tokenway.protocol.responses_bodies import (
    ErrorEvent,
    FunctionToolBody,
    IncompleteDetails,
    LifecycleEvent,
    LifecycleType,
    NamespaceToolBody,
    Response,
    ResponseStreamEvent,
    ResponseUsage,
)
from tokenway.server import sse
from tokenway.server.generation import STREAM_FAILED, Generation, framed_stream
from tokenway.server.responses_output import OutputItems
from tokenway.server.responses_prepare import PreparedResponse

logger = logging.getLogger(__name__)

# What happens to a finished Response before the client sees it: it is stored (or not).
OnEnd = Callable[[Response], Awaitable[None]]


def response_base(body: ResponsesRequest, prepared: PreparedResponse) -> Response:
    """The response as created (in_progress, no output): what every later state copies."""
    job = prepared.call.job
    text = body.text
    reasoning = body.reasoning
    return {
        "id": job.request_id, "object": "response", "created_at": prepared.created_at, "status": "in_progress",
        "background": bool(body.background), "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "model": job.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": reasoning.summary if reasoning else None},
        "safety_identifier": body.safety_identifier, "service_tier": openai_tier(job.service_class),
        "store": body.stored,
        "temperature": job.params.temperature, "text": {
            "format": _text_format(body), "verbosity": text.verbosity if text and text.verbosity else "medium"},
        # The tools the model was given: those left out are named in x-tokenway-omitted-tools.
        "tool_choice": _tool_choice(body),
        "tools": [_tool(tool) for tool in body.tools or () if not isinstance(tool, OmittedTool)],
        "top_logprobs": body.top_logprobs or 0, "top_p": job.params.top_p, "truncation": body.truncation or "disabled",
        "usage": None, "user": body.user,
    }


def _text_format(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJSONSchema):
        return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
                "strict": fmt.strict}
    return {"type": fmt.type if fmt is not None else "text"}


def _tool_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    if isinstance(choice, AllowedToolsChoice):
        return {"type": "allowed_tools", "mode": choice.mode,
                "tools": [{"type": "function", "name": tool.name} for tool in choice.tools]}
    return choice or "auto"


def _tool(tool: FunctionTool | NamespaceTool) -> FunctionToolBody | NamespaceToolBody:
    if isinstance(tool, NamespaceTool):
        return {"type": "namespace", "name": tool.name, "description": tool.description,
                "tools": [_function(function) for function in tool.functions]}
    return _function(tool)


def _function(tool: FunctionTool) -> FunctionToolBody:
    return {"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters,
            "strict": tool.strict is not False}


def response_usage(generation: Generation) -> ResponseUsage:
    """The chat path's usage, in the Responses API's names."""
    usage = generation.usage()
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": generation.num_reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


def finished(base: Response, generation: Generation, items: OutputItems) -> Response:
    """The response as its reply ended: completed, or incomplete where it was cut."""
    reason = generation.finish_reasons[0]
    incomplete: IncompleteDetails | None = {"reason": "max_output_tokens"} if reason == "length" else \
        {"reason": "content_filter"} if reason == "content_filter" else None
    response = base.copy()
    response["status"] = "completed" if incomplete is None else "incomplete"
    response["incomplete_details"] = incomplete
    response["completed_at"] = int(time.time()) if incomplete is None else None
    response["output"] = items.items
    response["usage"] = response_usage(generation)
    return response


def failed(base: Response, generation: Generation | None, items: OutputItems | None, error: TokenwayError
           ) -> Response:
    """The response as an error ended it, with what it had made so far."""
    response = base.copy()
    response["status"] = "failed"
    response["error"] = {"code": error_code(error), "message": error.message}
    if items is not None:
        response["output"] = items.items
    if generation is not None:
        response["usage"] = response_usage(generation)
    return response


def error_code(error: TokenwayError) -> str:
    """The Response error's code, in OpenAI's vocabulary for it."""
    if error.status == 429:
        return "rate_limit_exceeded"
    if error.status == 400:
        return "invalid_prompt"
    return "server_error"


def lifecycle(kind: LifecycleType, sequence: Iterator[int], response: Response) -> LifecycleEvent:
    return {"type": kind, "sequence_number": next(sequence), "response": response}


def named(event: ResponseStreamEvent) -> bytes:
    return sse.named_event(event["type"], event)


async def response_json(base: Response, generation: Generation, items: OutputItems, on_end: OnEnd | None
                        ) -> Response:
    """Run the reply to its end: the Response, handed to on_end (to be stored) as it is returned."""
    async for delta in generation.outputs():
        items.feed(delta)
    items.close(generation.finish_reasons[0])
    response = finished(base, generation, items)
    if on_end is not None:
        await on_end(response)
    return response


class ResponseStream:
    """One response's SSE stream: its events, and what ends it (response.completed, made and
    stored once the reply has ended: framed_stream sends `closing` after the ledger row is
    durable), or the error and response.failed."""

    def __init__(self, base: Response, generation: Generation, items: OutputItems, on_end: OnEnd | None) -> None:
        self.base, self.generation, self.items, self.on_end = base, generation, items, on_end
        self.sequence = items.sequence
        self.closing: list[bytes] = []  # filled by events() at the reply's end

    def framed(self) -> AsyncIterator[bytes]:
        return framed_stream(self.events(), self.generation, self.error_events, self.closing)

    async def events(self) -> AsyncIterator[bytes]:
        base, generation, items = self.base, self.generation, self.items
        yield named(lifecycle("response.created", self.sequence, base))
        yield named(lifecycle("response.in_progress", self.sequence, base))
        try:
            async for delta in generation.outputs():
                for event in items.feed(delta):
                    yield named(event)
        except Exception as exc:
            error = exc if isinstance(exc, TokenwayError) else InternalServerError(STREAM_FAILED)
            if self.on_end is not None:
                try:
                    await self.on_end(failed(base, generation, items, error))
                except TokenwayError as store_error:  # the stream's own error is the one to tell
                    logger.warning("response %s: its failure is not stored: %s", base["id"], store_error.message)
            raise
        for event in items.close(generation.finish_reasons[0]):
            yield named(event)
        response = finished(base, generation, items)
        if self.on_end is not None:
            await self.on_end(response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self.closing.append(named(lifecycle(kind, self.sequence, response)))

    def error_events(self, error: TokenwayError) -> list[bytes]:
        event: ErrorEvent = {"type": "error", "sequence_number": next(self.sequence), "code": error.code or error.type,
                             "message": error.message, "param": error.param}
        return [named(event), named(lifecycle("response.failed", self.sequence,
                                              failed(self.base, self.generation, self.items, error)))]
