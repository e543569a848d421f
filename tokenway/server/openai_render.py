"""OpenAI's response shapes for a Generation: /v1/chat/completions and /v1/completions as one
JSON body, or as SSE chunks framed the OpenAI way (an error is a `data: {"error": ...}` event;
both ways end with `data: [DONE]`). Logprobs in OpenAI's two shapes (TokenText)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence

from tokenway.frontend.model import ModelFrontend
from tokenway.protocol.errors import openai_error_body
from tokenway.protocol.job import ToolCallDelta
from tokenway.protocol.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from tokenway.protocol.outputs import TokenLogprob
from tokenway.server import sse
from tokenway.server.generation import Generation, framed_stream


class TokenText:
    """Logprobs in OpenAI's two shapes, with token texts from the tokenizer's shared cache. An
    upstream's logprobs come OpenAI-shaped already (dicts, chat's shape) and pass through."""

    def __init__(self, frontend: ModelFrontend | None) -> None:
        self.text: Callable[[int], str] = frontend.tokenizer.token_text if frontend is not None else _no_tokenizer

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob | dict], top_n: int) -> list[dict]:
        entries = []
        for lp in logprobs:
            if isinstance(lp, dict):
                entries.append(lp | {"top_logprobs": (lp.get("top_logprobs") or [])[:top_n]})
                continue
            token = self.text(lp.token_id)
            entries.append({
                "token": token,
                "logprob": lp.logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": (t := self.text(tid)), "logprob": value, "bytes": list(t.encode())}
                    for tid, value in lp.top[:top_n]
                ],
            })
        return entries

    def completion_logprobs(self, logprobs: Sequence[TokenLogprob | dict], offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
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


def chunk_encoder(generation: Generation, object_name: str, with_usage: bool) -> Callable[..., bytes]:
    """The SSE event for one chunk of a stream; `usage` rides on every chunk when asked for
    (null until the last), as OpenAI sends it."""
    created = int(time.time())

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {"id": generation.request_id, "object": object_name, "created": created,
                   "model": generation.model, "choices": choices, "system_fingerprint": None}
        if with_usage:
            payload["usage"] = usage
        return sse.data_event(payload)

    return chunk


def openai_finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def include_usage(body: SamplingRequest) -> bool:
    """stream_options.include_usage: every chunk carries `usage`, the last one (no choices) its value."""
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- chat ------------------------------------------------------------------------------


async def chat_response(body: ChatCompletionRequest, generation: Generation) -> dict:
    token_text = TokenText(generation.frontend)
    choices = []
    for result in await generation.final_outputs():
        finish_reason = openai_finish_reason(result.finish_reason)
        if result.tool_calls:
            message = {"role": "assistant", "content": result.text or None,
                       "tool_calls": [call.openai() for call in result.tool_calls]}
        else:
            message = {"role": "assistant", "content": result.text}
        choice = {"index": result.index, "message": message, "finish_reason": finish_reason, "logprobs": None}
        if body.logprobs and result.logprobs is not None:
            choice["logprobs"] = {"content": token_text.chat_logprobs(result.logprobs, body.top_logprobs or 0)}
        choices.append(choice)
    return {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": generation.model,
        "choices": choices,
        "usage": generation.usage(),
        "system_fingerprint": None,
    }


async def chat_stream(body: ChatCompletionRequest, generation: Generation) -> AsyncIterator[bytes]:
    token_text = TokenText(generation.frontend)
    with_usage = include_usage(body)
    chunk = chunk_encoder(generation, "chat.completion.chunk", with_usage)

    for index in range(generation.num_choices):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for delta in generation.outputs():
        index = delta.index
        finish_reason = openai_finish_reason(delta.finish_reason)
        logprobs = None
        if body.logprobs and delta.logprobs is not None:
            logprobs = {"content": token_text.chat_logprobs(delta.logprobs, body.top_logprobs or 0)}
        if delta.text or logprobs:
            yield chunk([{"index": index, "delta": {"content": delta.text}, "logprobs": logprobs,
                          "finish_reason": None}])
        if delta.tool_calls:
            yield chunk([{"index": index, "delta": {"tool_calls": [tool_call_piece(p) for p in delta.tool_calls]},
                          "logprobs": None, "finish_reason": None}])
        if finish_reason is not None:
            yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
    if with_usage:
        yield chunk([], generation.usage())


def tool_call_piece(piece: ToolCallDelta) -> dict:
    """A streamed tool call's piece in OpenAI's delta.tool_calls: id, type and name on its first."""
    function = {"arguments": piece.arguments}
    if piece.name is not None:
        function = {"name": piece.name} | function
    head = {"id": piece.id, "type": "function"} if piece.id is not None else {}
    return {"index": piece.index, **head, "function": function}


# ---- completions -----------------------------------------------------------------------


async def completion_response(body: CompletionRequest, generation: Generation, echo: str) -> dict:
    token_text = TokenText(generation.frontend)
    choices = []
    for result in await generation.final_outputs():
        logprobs = None
        if body.logprobs is not None and result.logprobs is not None:
            logprobs = token_text.completion_logprobs(result.logprobs, len(echo))
        choices.append({"index": result.index, "text": echo + result.text, "logprobs": logprobs,
                        "finish_reason": openai_finish_reason(result.finish_reason)})
    return {"id": generation.request_id, "object": "text_completion", "created": int(time.time()),
            "model": generation.model, "choices": choices, "usage": generation.usage(), "system_fingerprint": None}


async def completion_stream(body: CompletionRequest, generation: Generation, echo: str
                            ) -> AsyncIterator[bytes]:
    token_text = TokenText(generation.frontend)
    with_usage = include_usage(body)
    chunk = chunk_encoder(generation, "text_completion", with_usage)
    offsets = [len(echo)] * generation.num_choices

    if echo:
        for index in range(generation.num_choices):
            yield chunk([{"index": index, "text": echo, "logprobs": None, "finish_reason": None}])
    async for delta in generation.outputs():
        index = delta.index
        logprobs = None
        if body.logprobs is not None and delta.logprobs is not None:
            logprobs = token_text.completion_logprobs(delta.logprobs, offsets[index])
        offsets[index] += len(delta.text)
        finish_reason = openai_finish_reason(delta.finish_reason)
        if delta.text or logprobs or finish_reason:
            yield chunk([{"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish_reason}])
    if with_usage:
        yield chunk([], generation.usage())


def guarded_stream(events: AsyncIterator[bytes], generation: Generation) -> AsyncIterator[bytes]:
    """OpenAI's framing: an error is a `data: {"error": ...}` event; both ways end with [DONE]."""
    return framed_stream(events, generation, lambda exc: [sse.data_event(openai_error_body(exc)), sse.DONE],
                         [sse.DONE])
