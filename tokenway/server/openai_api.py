"""POST /v1/chat/completions and /v1/completions: OpenAI's shapes, JSON or SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.templating import context_window, prompt_fields, templated_token_ids
from tokenway.gateway.call import Call
from tokenway.protocol.errors import ContextLengthExceededError, InvalidRequestError, openai_error_body
from tokenway.protocol.job import GenerationJob, ToolCallDelta, estimate_tokens
from tokenway.protocol.outputs import TokenLogprob
from tokenway.safety.channels import ChatInput, screen_chat, screen_prompts
from tokenway.server import sse
from tokenway.server.generation import Generation, framed_stream
from tokenway.server.serving import ServerState, make_sampling_params, new_id


class TokenText:
    """Logprobs in OpenAI's two shapes, with token texts from the tokenizer's shared cache. An
    upstream's logprobs come OpenAI-shaped already (dicts, chat's shape) and pass through."""

    def __init__(self, frontend: ModelFrontend | None) -> None:
        self.text = frontend.tokenizer.token_text if frontend is not None else None

    def chat_logprobs(self, logprobs: list[TokenLogprob | dict], top_n: int) -> list[dict]:
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

    def completion_logprobs(self, logprobs: list[TokenLogprob | dict], offset: int) -> dict:
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


def chunk_encoder(generation: Generation, object_name: str, include_usage: bool) -> Callable[..., bytes]:
    """The SSE event for one chunk of a stream; `usage` rides on every chunk when asked for
    (null until the last), as OpenAI sends it."""
    created = int(time.time())

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {"id": generation.request_id, "object": object_name, "created": created,
                   "model": generation.model, "choices": choices, "system_fingerprint": None}
        if include_usage:
            payload["usage"] = usage
        return sse.data_event(payload)

    return chunk


def openai_finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


# ---- chat ------------------------------------------------------------------------------


def prepare_chat(state: ServerState, body, call: Call) -> tuple[Generation]:
    """The adaptor for chat: the body becomes one GenerationJob."""
    model = state.route(body, call)
    if body.logprobs and body.top_logprobs is None:
        top_logprobs = 0
    else:
        top_logprobs = body.top_logprobs
    tools = body.template_tools()
    tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump(exclude_none=True)
    response_format = (body.response_format.model_dump(exclude_none=True, by_alias=True)
                       if body.response_format else None)
    chat_input = screen_chat(partial(state.screen, call), ChatInput(body.template_messages(), tools, response_format))
    tools, response_format = chat_input.tools, chat_input.response_format
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    logprobs = top_logprobs if body.logprobs else None
    chat = state.template_chat(call, model, chat_input.messages, tools, tool_choice, body.max_output_tokens, param,
                               len(body.messages), body.parallel_tool_calls, response_format,
                               body.continue_final_message)
    params = make_sampling_params(body, chat.max_tokens, chat.structured, logprobs, body.stop,
                                  chat.skip_special_tokens)
    job = GenerationJob(new_id("chatcmpl-"), model, "chat", params, n=body.n or 1, messages=chat.messages,
                        tools=tuple(tools) if tools else None, tool_choice=tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls is not False, response_format=response_format,
                        prompt_token_ids=chat.prompt_token_ids, context_window=chat.context_window,
                        stream=bool(body.stream))
    return (Generation(state, call, job, chat.reply_format),)


async def chat_response(state: ServerState, body, generation: Generation) -> dict:
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


async def chat_stream(state: ServerState, body, generation: Generation) -> AsyncIterator[bytes]:
    token_text = TokenText(generation.frontend)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = chunk_encoder(generation, "chat.completion.chunk", include_usage)

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
    if include_usage:
        yield chunk([], generation.usage())


def tool_call_piece(piece: ToolCallDelta) -> dict:
    """A streamed tool call's piece in OpenAI's delta.tool_calls: id, type and name on its first."""
    function = {"arguments": piece.arguments}
    if piece.name is not None:
        function = {"name": piece.name} | function
    head = {"id": piece.id, "type": "function"} if piece.id is not None else {}
    return {"index": piece.index, **head, "function": function}


# ---- completions -----------------------------------------------------------------------


def completion_prompts(frontend: ModelFrontend, prompt: Any) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token id lists."""
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    with context_window(frontend, "prompt") as window:
        if isinstance(prompt, str):
            return [frontend.tokenizer.encode(prompt, max_num_tokens=window)]
        return [frontend.tokenizer.encode(item, max_num_tokens=window) if isinstance(item, str) else list(item)
                for item in prompt]


def tokenize(frontend: ModelFrontend, body, tool_parser: str | None = None, window_limit: bool = True) -> list[int]:
    """POST /tokenize (vLLM's): a prompt or chat messages -> token ids; a text certainly over
    the window is refused as a generation would be (and as vLLM does). Messages with the
    generation prompt are templated by the chat path itself (tools, response_format and all),
    so the count is the prompt_tokens a chat call with the same fields reports. window_limit
    False (a caller's own counting, tokenway.client.LocalCounter): any length is counted."""
    tokenizer = frontend.tokenizer
    if body.messages is not None and body.add_generation_prompt and body.add_special_tokens is not True:
        return templated_token_ids(frontend, [m.to_template_dict() for m in body.messages], *prompt_fields(body),
                                   tool_parser, window_limit)
    if body.messages is not None:
        messages = [m.to_template_dict() for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        add_special_tokens, param = body.add_special_tokens is True, "messages"
    else:
        text, add_special_tokens, param = body.prompt or "", body.add_special_tokens is not False, "prompt"
    with context_window(frontend, param) as window:
        token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens, max_num_tokens=window)
    if len(token_ids) > window:
        raise ContextLengthExceededError(len(token_ids), None, window, param=param)
    return token_ids


def screen_prompt(state: ServerState, body, call: Call) -> None:
    """The safety stage for a completion: each prompt's text, token ids decoded with the
    model's tokenizer first; a redacted prompt given as token ids becomes its redacted text.
    Token ids for a model tokenway has no tokenizer for cannot be read: refused under a block
    or redact policy, passed unread under flag."""
    frontend = state.frontend(call.model)

    def decode(token_ids: Sequence[int]) -> str:
        if frontend is not None:
            return frontend.tokenizer.decode(t for t in token_ids if t < frontend.vocab_size)
        if state.safety_policy(call.model, call.start.principal).input in ("block", "redact"):
            raise InvalidRequestError(
                "prompt: this server's content policy reads every prompt, and token ids for this model "
                "cannot be read (tokenway has no tokenizer for it); send the prompt as text", param="prompt",
                code="content_policy_unreadable")
        return ""

    prompts = body.prompts
    redacted = screen_prompts(partial(state.screen, call, param="prompt"), prompts, decode, "prompt")
    if redacted is not None:
        new = [prompt if text is None else text for prompt, text in zip(prompts, redacted)]
        body.prompt = new if prompts is body.prompt else new[0]  # prompts wraps a single prompt in a list


def prepare_completion(state: ServerState, body, call: Call) -> tuple[Generation, str]:
    model = state.route(body, call)
    screen_prompt(state, body, call)
    frontend = state.frontend(model)
    if frontend is None:
        return prepare_untemplated_completion(state, body, call, model)
    prompts = completion_prompts(frontend, body.prompt)
    if len(prompts) != 1:
        raise one_prompt_only()
    prompt_token_ids = prompts[0]
    if not prompt_token_ids:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    vocab_size = frontend.vocab_size
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
    max_tokens = state.max_tokens(call, frontend.max_model_len, len(prompt_token_ids), body.max_tokens, "max_tokens")
    params = make_sampling_params(body, max_tokens, None, body.logprobs, body.stop)
    text = body.prompt if isinstance(body.prompt, str) else None
    job = GenerationJob(new_id("cmpl-"), model, "completion", params, n=body.n or 1, prompt=text,
                        prompt_token_ids=tuple(prompt_token_ids), context_window=frontend.max_model_len,
                        stream=bool(body.stream))
    echo = frontend.tokenizer.decode(prompt_token_ids) if body.echo else ""
    return Generation(state, call, job), echo


def one_prompt_only() -> InvalidRequestError:
    # Batched prompts would be n choices each; one prompt per call keeps billing exact.
    return InvalidRequestError("prompt: send one prompt per request (a list of prompts is not supported)",
                               param="prompt")


def prepare_untemplated_completion(state: ServerState, body, call: Call, model: str) -> tuple[Generation, str]:
    """A completion for a model tokenway has no tokenizer for: the caller's text (or token ids,
    in the upstream's vocabulary) goes as it came."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        if len(prompt) != 1:
            raise one_prompt_only()
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    text = prompt if isinstance(prompt, str) else None
    if body.echo and text is None:
        raise InvalidRequestError("echo: needs the prompt as text for this model (tokenway has no tokenizer to "
                                  "decode its token ids)", param="echo")
    window = state.max_model_len(model)
    num_prompt_tokens = estimate_tokens(text) if text is not None else len(prompt)
    max_tokens = state.max_tokens(call, window, num_prompt_tokens, body.max_tokens, "max_tokens", exact=False)
    params = make_sampling_params(body, max_tokens, None, body.logprobs, body.stop)
    job = GenerationJob(new_id("cmpl-"), model, "completion", params, n=body.n or 1, prompt=text,
                        prompt_token_ids=None if text is not None else tuple(prompt), context_window=window,
                        stream=bool(body.stream))
    return Generation(state, call, job), (text if body.echo else "")


async def completion_response(state: ServerState, body, generation: Generation, echo: str) -> dict:
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


async def completion_stream(state: ServerState, body, generation: Generation, echo: str) -> AsyncIterator[bytes]:
    token_text = TokenText(generation.frontend)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = chunk_encoder(generation, "text_completion", include_usage)
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
    if include_usage:
        yield chunk([], generation.usage())


def guarded_stream(events: AsyncIterator[bytes], generation: Generation) -> AsyncIterator[bytes]:
    """OpenAI's framing: an error is a `data: {"error": ...}` event; both ways end with [DONE]."""
    return framed_stream(events, generation, lambda exc: [sse.data_event(openai_error_body(exc)), sse.DONE],
                         [sse.DONE])
