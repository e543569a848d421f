"""OpenAI's response shapes for a Generation: /v1/chat/completions and /v1/completions as one
JSON body, or as SSE chunks framed the OpenAI way (an error is a `data: {"error": ...}` event;
both ways end with `data: [DONE]`). Logprobs in OpenAI's two shapes (TokenText).

Every body is one of protocol/openai_bodies.py's TypedDicts, written as a dict literal: pyright
checks each key and value, and a chunk costs no more than the dict it is.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenway.frontend.model import ModelFrontend
from tokenway.gateway.tiers import openai_tier
from tokenway.protocol.errors import openai_error_body
from tokenway.protocol.job import ToolCallDelta
from tokenway.protocol.openai_bodies import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionTokenLogprob,
    ChatFinishReason,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionFinishReason,
    CompletionLogprobs,
    CompletionUsage,
    TopLogprob,
)
from tokenway.protocol.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from tokenway.protocol.outputs import TokenLogprob
from tokenway.server import sse
from tokenway.server.generation import Generation, ToolCall, framed_stream

# An upstream's logprobs entry: OpenAI's chat shape already (token, logprob, bytes, top_logprobs).
UpstreamLogprob = dict[str, Any]


class TokenText:
    """Logprobs in OpenAI's two shapes, with token texts from the tokenizer's shared cache. An
    upstream's entries come OpenAI-shaped (routing/openai_upstream.py) and pass on, their known
    keys only."""

    def __init__(self, frontend: ModelFrontend | None) -> None:
        self.text: Callable[[int], str] = frontend.tokenizer.token_text if frontend is not None else _no_tokenizer

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob | UpstreamLogprob], top_n: int) -> ChoiceLogprobs:
        return {"content": [self._chat_entry(lp, top_n) for lp in logprobs], "refusal": None}

    def _chat_entry(self, lp: TokenLogprob | UpstreamLogprob, top_n: int) -> ChatCompletionTokenLogprob:
        if isinstance(lp, dict):
            top: list[TopLogprob] = [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
                                     for t in (lp.get("top_logprobs") or [])[:top_n]]
            return {"token": lp["token"], "logprob": lp["logprob"], "bytes": lp.get("bytes"), "top_logprobs": top}
        token = self.text(lp.token_id)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (t := self.text(tid)), "logprob": value, "bytes": list(t.encode())}
                                 for tid, value in lp.top[:top_n]]}

    def completion_logprobs(self, logprobs: Sequence[TokenLogprob | UpstreamLogprob], offset: int
                            ) -> CompletionLogprobs:
        """offset: where the first token starts in the choice's text (after an echoed prompt)."""
        tokens: list[str] = []
        token_logprobs: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for lp in logprobs:
            if isinstance(lp, dict):
                token, logprob = lp["token"], lp["logprob"]
                top = {t["token"]: t["logprob"] for t in lp.get("top_logprobs") or ()}
            else:
                token, logprob = self.text(lp.token_id), lp.logprob
                top = {self.text(tid): value for tid, value in lp.top}
            tokens.append(token)
            token_logprobs.append(logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _no_tokenizer(token_id: int) -> str:
    raise AssertionError("token ids come only from replicas of a model tokenway has the tokenizer of")


def completion_finish_reason(reason: str | None) -> CompletionFinishReason:
    """A choice's finish_reason in OpenAI's words: an abort (the caller's own stop, a drained
    replica) and any reason OpenAI has no word for are "stop"."""
    if reason in ("length", "content_filter"):
        return reason
    return "stop"


def chat_finish_reason(reason: str | None) -> ChatFinishReason:
    return "tool_calls" if reason == "tool_calls" else completion_finish_reason(reason)


def include_usage(body: SamplingRequest) -> bool:
    """stream_options.include_usage: every chunk carries `usage`, the last one (no choices) its value."""
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- chat ------------------------------------------------------------------------------


async def chat_response(body: ChatCompletionRequest, generation: Generation) -> ChatCompletion:
    token_text = TokenText(generation.frontend)
    top_n = body.top_logprobs or 0
    choices: list[ChatCompletionChoice] = []
    for result in await generation.final_outputs():
        tool_calls = [message_tool_call(call) for call in result.tool_calls] or None
        logprobs = None
        if body.logprobs and result.logprobs is not None:
            logprobs = token_text.chat_logprobs(result.logprobs, top_n)
        message: ChatCompletionMessage = {"role": "assistant", "content": (result.text or None) if tool_calls
                                          else result.text, "refusal": None, "tool_calls": tool_calls}
        if result.reasoning:
            message["reasoning_content"] = message["reasoning"] = result.reasoning
        choices.append({
            "index": result.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": chat_finish_reason(result.finish_reason),
        })
    return {"id": generation.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": generation.model, "choices": choices, "usage": generation.usage(),
            "system_fingerprint": None, "service_tier": openai_tier(generation.job.service_class)}


def message_tool_call(call: ToolCall) -> ChatCompletionMessageToolCall:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def chat_stream(body: ChatCompletionRequest, generation: Generation) -> AsyncIterator[bytes]:
    token_text = TokenText(generation.frontend)
    top_n = body.top_logprobs or 0
    with_usage = include_usage(body)
    created = int(time.time())
    tier = openai_tier(generation.job.service_class)

    def chunk(choices: list[ChatCompletionChunkChoice], usage: CompletionUsage | None = None) -> bytes:
        payload: ChatCompletionChunk = {"id": generation.request_id, "object": "chat.completion.chunk",
                                        "created": created, "model": generation.model, "choices": choices,
                                        "system_fingerprint": None, "service_tier": tier}
        if with_usage:  # on every chunk, null until the last, as OpenAI sends it
            payload["usage"] = usage
        return sse.data_event(payload)

    for index in range(generation.num_choices):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for delta in generation.outputs():
        index = delta.index
        logprobs = token_text.chat_logprobs(delta.logprobs, top_n) if body.logprobs and delta.logprobs else None
        if delta.text or delta.reasoning or logprobs:
            yield chunk([{"index": index, "delta": content_piece(delta.text, delta.reasoning), "logprobs": logprobs,
                          "finish_reason": None}])
        if delta.tool_calls:
            yield chunk([{"index": index, "delta": {"tool_calls": [tool_call_piece(p) for p in delta.tool_calls]},
                          "logprobs": None, "finish_reason": None}])
        if delta.finish_reason is not None:
            yield chunk([{"index": index, "delta": {}, "logprobs": None,
                          "finish_reason": chat_finish_reason(delta.finish_reason)}])
    if with_usage:
        yield chunk([], generation.usage())


def content_piece(text: str, reasoning: str) -> ChoiceDelta:
    """A delta's content and thinking, each only where there is some (a delta bearing neither,
    logprobs only, carries an empty content)."""
    piece: ChoiceDelta = {}
    if reasoning:
        piece["reasoning_content"] = piece["reasoning"] = reasoning
    if text or not reasoning:
        piece["content"] = text
    return piece


def tool_call_piece(piece: ToolCallDelta) -> ChoiceDeltaToolCall:
    """A streamed tool call's piece in OpenAI's delta.tool_calls: id, type and name on its first."""
    function: ChoiceDeltaToolCallFunction = {"arguments": piece.arguments}
    if piece.name is not None:
        function = {"name": piece.name, "arguments": piece.arguments}
    if piece.id is None:
        return {"index": piece.index, "function": function}
    return {"index": piece.index, "id": piece.id, "type": "function", "function": function}


# ---- completions -----------------------------------------------------------------------


async def completion_response(body: CompletionRequest, generation: Generation, echo: str) -> Completion:
    token_text = TokenText(generation.frontend)
    choices: list[CompletionChoice] = []
    for result in await generation.final_outputs():
        logprobs = None
        if body.logprobs is not None and result.logprobs is not None:
            logprobs = token_text.completion_logprobs(result.logprobs, len(echo))
        choices.append({"index": result.index, "text": echo + result.text, "logprobs": logprobs,
                        "finish_reason": completion_finish_reason(result.finish_reason)})
    return {"id": generation.request_id, "object": "text_completion", "created": int(time.time()),
            "model": generation.model, "choices": choices, "usage": generation.usage(),
            "system_fingerprint": None, "service_tier": openai_tier(generation.job.service_class)}


async def completion_stream(body: CompletionRequest, generation: Generation, echo: str
                            ) -> AsyncIterator[bytes]:
    token_text = TokenText(generation.frontend)
    with_usage = include_usage(body)
    created = int(time.time())
    offsets = [len(echo)] * generation.num_choices
    tier = openai_tier(generation.job.service_class)

    def chunk(choices: list[CompletionChunkChoice], usage: CompletionUsage | None = None) -> bytes:
        payload: CompletionChunk = {"id": generation.request_id, "object": "text_completion", "created": created,
                                    "model": generation.model, "choices": choices, "system_fingerprint": None,
                                    "service_tier": tier}
        if with_usage:
            payload["usage"] = usage
        return sse.data_event(payload)

    if echo:
        for index in range(generation.num_choices):
            yield chunk([{"index": index, "text": echo, "logprobs": None, "finish_reason": None}])
    async for delta in generation.outputs():
        index = delta.index
        logprobs = None
        if body.logprobs is not None and delta.logprobs:
            logprobs = token_text.completion_logprobs(delta.logprobs, offsets[index])
        offsets[index] += len(delta.text)
        finish_reason = None if delta.finish_reason is None else completion_finish_reason(delta.finish_reason)
        if delta.text or logprobs or finish_reason:
            yield chunk([{"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish_reason}])
    if with_usage:
        yield chunk([], generation.usage())


def guarded_stream(events: AsyncIterator[bytes], generation: Generation) -> AsyncIterator[bytes]:
    """OpenAI's framing: an error is a `data: {"error": ...}` event; both ways end with [DONE]."""
    return framed_stream(events, generation, lambda exc: [sse.data_event(openai_error_body(exc)), sse.DONE],
                         [sse.DONE])
