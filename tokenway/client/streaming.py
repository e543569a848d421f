"""What a chat stream delivered, whole or broken: the reply so far, as a typed result.

    accumulator = Accumulator()
    for chunk in stream: accumulator.add(chunk)   # openai ChatCompletionChunks, or anthropic's events
    result = accumulator.result(error=None)               # a StreamResult
    result.complete, result.text, result.tool_calls, result.finish_reason, result.usage
    messages.append(result.message())                     # put the reply back into the conversation
    request = result.continue_request(request)            # ask the server to go on from the break

Chunks of either SDK are taken (the Messages API's events: text and tool_use blocks, the stop
reason and usage of message_delta). The first choice is accumulated (n > 1 streams are for
sampling, not for resuming). A tool call is kept only when its arguments are a whole JSON object: a call that a break or
max_tokens cut mid-arguments is dropped here, and counted in `num_cut_tool_calls` (the stream
itself cannot take back what it sent). A JSON object's text
that parses is complete, since no proper prefix of an object's text is an object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the API sends it

    def as_message_call(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class StreamResult:
    complete: bool  # the stream ended with a finish_reason; False: it broke (see `error`)
    text: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    usage: Any  # the SDK's CompletionUsage, where the stream sent one
    num_chunks: int
    num_cut_tool_calls: int = 0  # begun but not whole: dropped from tool_calls
    error: BaseException | None = None
    ttft: float | None = None  # seconds from the request to the first token
    endpoint: str = ""  # which endpoint answered (ResilientChat)
    api: str = "openai"  # or "anthropic": the shape of message() and continue_request()

    def message(self) -> dict[str, Any]:
        """The reply as an assistant message, for the next request's messages."""
        if self.api == "anthropic":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": self.text}] if self.text else []
            blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                       for c in self.tool_calls]
            return {"role": "assistant", "content": blocks}
        message: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            message["tool_calls"] = [call.as_message_call() for call in self.tool_calls]
        return message

    def continue_request(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The request that goes on from the text that arrived: the text as the assistant's
        reply begun, with vLLM's continue_final_message (tokenway and vLLM take it; for the
        Messages API a last assistant message is prefill by itself). Only text continues: a
        reply that had begun a tool call is asked again."""
        if self.complete:
            raise ValueError("continue_request: the stream completed; there is nothing to continue")
        if self.tool_calls or self.num_cut_tool_calls or not self.text:
            return dict(request)
        if self.api == "anthropic":
            return {**request, "messages": [*request["messages"], {"role": "assistant", "content": self.text}]}
        extra = dict(request.get("extra_body") or {})
        extra["continue_final_message"] = True
        return {**request, "messages": [*request["messages"], {"role": "assistant", "content": self.text}],
                "extra_body": extra}


class Accumulator:
    def __init__(self) -> None:
        self.num_chunks = 0
        self._text: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.has_token = False  # any content, tool call or finish arrived
        self.api = "openai"

    def add(self, chunk: Any) -> None:
        self.num_chunks += 1
        if not hasattr(chunk, "choices"):
            self.api = "anthropic"
            self._add_event(chunk)
            return
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        for choice in chunk.choices or ():
            if choice.index != 0:
                continue
            delta = choice.delta
            if delta is not None and delta.content:
                self._text.append(delta.content)
                self.has_token = True
            for call in (delta.tool_calls or ()) if delta is not None else ():
                self.has_token = True
                slot = self._calls.setdefault(call.index, ["", "", ""])
                if call.id:
                    slot[0] = call.id
                if call.function is not None:
                    slot[1] += call.function.name or ""
                    slot[2] += call.function.arguments or ""
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
                self.has_token = True

    def _add_event(self, event: Any) -> None:
        kind = event.type
        if kind == "content_block_start":
            block = event.content_block
            if block.type == "tool_use":
                self._calls[event.index] = [block.id, block.name, ""]
                self.has_token = True
        elif kind == "content_block_delta":
            delta = event.delta
            if delta.type == "text_delta" and delta.text:
                self._text.append(delta.text)
                self.has_token = True
            elif delta.type == "input_json_delta" and event.index in self._calls:
                self._calls[event.index][2] += delta.partial_json
        elif kind == "content_block_stop" and event.index in self._calls and not self._calls[event.index][2]:
            self._calls[event.index][2] = "{}"  # a call with no input sends no delta
        elif kind == "message_delta":
            self.finish_reason = event.delta.stop_reason
            self.usage = event.usage
            self.has_token = True

    def result(self, error: BaseException | None = None, ttft: float | None = None,
               endpoint: str = "") -> StreamResult:
        calls = [ToolCall(*slot) for _, slot in sorted(self._calls.items())]
        whole = tuple(call for call in calls if _is_object(call.arguments))
        return StreamResult(complete=error is None and self.finish_reason is not None, text="".join(self._text),
                            tool_calls=whole, finish_reason=self.finish_reason, usage=self.usage,
                            num_chunks=self.num_chunks, num_cut_tool_calls=len(calls) - len(whole), error=error,
                            ttft=ttft, endpoint=endpoint, api=self.api)


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
