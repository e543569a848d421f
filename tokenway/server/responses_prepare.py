"""The adaptor for /v1/responses: a Responses body, and the stored conversation it continues,
become the chat path's job, through the chat path's own steps (server/prepare.py), so that
keys, limits, budgets, the ledger, traces and safety apply as they do to a chat call:

    ResponsesRequest ─► input_items (each with its id)            protocol/responses.py
    History (previous_response_id: the stored chain, oldest first) + the new items
        ─► chat_messages: instructions as the system message, items as chat messages
        ─► route ─► screen_chat ─► chat_prompt (truncation auto: fitted) ─► SamplingParams
        ─► GenerationJob (request_id "resp_...": the response's id, the ledger's and the trace's)
        ─► prepared() ─► PreparedResponse

Item to message: a message is a message (developer is system; its parts' texts joined); a
function_call joins the assistant message before it as a tool call (or starts one); a
function_call_output is a tool message; a reasoning item's thinking (responses_items.py's
reasoning_text) is the reasoning_content of the assistant turn it precedes, which a template
that thinks renders where it keeps thinking (Qwen3's: the turns after the last user message) and
any other leaves out. reasoning.effort is the call's ThinkingRequest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenway.frontend.templating import template_chat
from tokenway.gateway.call import Call
from tokenway.gateway.tiers import openai_ask
from tokenway.protocol.errors import ContentPolicyViolationError, ContextLengthExceededError, InvalidRequestError
from tokenway.protocol.job import GenerationJob, estimate_chat_tokens
from tokenway.protocol.responses import ResponsesPrompt, ResponsesRequest
from tokenway.protocol.responses_bodies import InputItem, OutputItem
from tokenway.protocol.responses_items import reasoning_text
from tokenway.protocol.sampling import SamplingParams
from tokenway.safety.channels import ChatInput, screen_chat
from tokenway.server.prepare import (
    ChatTemplating,
    PreparedCall,
    chat_prompt,
    field_errors,
    new_id,
    prepared,
    reasoning_parser,
    route,
    screen,
    service_class,
)
from tokenway.server.services import Services


@dataclass(frozen=True, slots=True)
class History:
    """The conversation a previous_response_id continues: every stored response's input items
    and output items, oldest first (instructions are not carried over, as OpenAI does)."""

    items: tuple[InputItem | OutputItem, ...] = ()
    model: str | None = None  # the previous response's model: the default for one that names none


@dataclass(frozen=True, slots=True)
class PreparedResponse:
    """A Responses call, prepared: the chat path's PreparedCall and what the response keeps."""

    call: PreparedCall  # its job's request_id is the response's id
    input_items: tuple[InputItem, ...]  # this response's own input, as stored and listed
    created_at: int  # unix seconds
    num_dropped_messages: int = 0  # truncation auto: the oldest messages left out of the prompt

    @property
    def response_id(self) -> str:
        return self.call.job.request_id


def chat_messages(instructions: str | None, items: Sequence[InputItem | OutputItem]) -> list[dict[str, Any]]:
    """The conversation in the chat path's message shape (OpenAI chat, as to_template_dict makes it)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    joinable = False  # the last message is an assistant's that a function_call may join
    thinking: list[str] = []  # reasoning items' text, for the assistant turn they precede

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if thinking:
            message["reasoning_content"] = "\n\n".join(thinking)
            thinking.clear()
        return message

    for item in items:
        if item["type"] == "message":
            role = item["role"]
            text = "".join(part["text"] for part in item["content"])
            message = {"role": "system" if role == "developer" else role, "content": text}
            messages.append(assistant(message) if role == "assistant" else message)
            joinable = role == "assistant"
            thinking.clear()  # thinking before another's message belongs to no assistant turn
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if joinable and not thinking:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:  # thinking between two calls opens a turn of its own, as the model wrote it
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
                joinable = True
        elif item["type"] == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            joinable = False
        elif item["type"] == "reasoning" and (text := reasoning_text(item)):
            thinking.append(text)
    return messages


def prepare_response(services: Services, body: ResponsesRequest, call: Call, history: History) -> PreparedResponse:
    """The adaptor: the body and its history become one GenerationJob (a chat job)."""
    if body.model is None and history.model is None:
        raise InvalidRequestError("model: is required (unless previous_response_id names a response to take it "
                                  "from)", param="model")
    model = route(services, call, body.model or history.model)
    tier = service_class(services, call, openai_ask(body.service_tier))
    policy = services.safety_policy(model, call.start.principal)
    input_items, messages = conversation(body, history)
    tools, tool_choice = body.chat_tools(), body.chat_tool_choice()
    try:
        chat = screen_chat(partial(screen, call, policy, param="input"),
                           ChatInput(messages, tools, body.response_format()))
    except ContentPolicyViolationError as exc:
        raise naming_fields(exc) from None
    templating, num_dropped = fitted_prompt(services, call, model, chat, tool_choice, body, body.max_output_tokens)
    with field_errors():
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, max_tokens=templating.max_tokens,
            logprobs=(body.top_logprobs or 0) if body.wants_logprobs else None,
            structured_output=templating.structured, skip_special_tokens=templating.skip_special_tokens,
            reasoning_budget=templating.reasoning_budget)
    job = GenerationJob(call.start.new_id("resp_"), model, "chat", params, messages=templating.messages,
                        tools=tuple(chat.tools) if chat.tools else None, omitted_tools=body.omitted_tools(),
                        tool_choice=tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls is not False,
                        response_format=chat.response_format, prompt_token_ids=templating.prompt_token_ids,
                        context_window=templating.context_window, stream=bool(body.stream), thinking=body.thinking(),
                        service_class=tier)
    prepared_call = prepared(services, call, job, services.catalog.frontend(model), policy, templating.reply_format,
                             reasoning=templating.reasoning)
    return PreparedResponse(prepared_call, input_items, int(time.time()), num_dropped)


def count_input_tokens(services: Services, body: ResponsesPrompt, call: Call, history: History) -> int:
    """POST /v1/responses/input_tokens: the prompt's length as a response with this body would
    have it (truncated as it would be); an estimate for a model tokenway has no tokenizer for.
    Without a model (OpenAI's is optional here), the first one served."""
    model = route(services, call, body.model or history.model or services.catalog.chat_model_names[0])
    _, messages = conversation(body, history)
    chat = ChatInput(messages, body.chat_tools(), body.response_format())
    templating, _ = fitted_prompt(services, call, model, chat, body.chat_tool_choice(), body, None)
    if templating.prompt_token_ids is None:
        return estimate_chat_tokens(templating.messages, chat.tools)
    return len(templating.prompt_token_ids)


def conversation(body: ResponsesPrompt, history: History) -> tuple[tuple[InputItem, ...], list[dict[str, Any]]]:
    """The body's input items (each with its id) and the whole conversation as chat messages."""
    input_items = tuple(body.input_items(new_id))
    messages = chat_messages(body.instructions, (*history.items, *input_items))
    if not any(message["role"] != "system" for message in messages):
        raise InvalidRequestError("input: is required (a text or items), unless previous_response_id names a "
                                  "conversation to continue", param="input")
    return input_items, messages


def fitted_prompt(services: Services, call: Call, model: str, chat: ChatInput, tool_choice: Any,
                  body: ResponsesPrompt, max_output_tokens: int | None) -> tuple[ChatTemplating, int]:
    """The chat path's templating of the conversation, and how many of its oldest messages
    truncation auto left out to fit the window (0 under disabled, which is the 400 instead).
    The instructions are never left out, nor the last message; a tool result is not kept
    without the call it answers. Finding the cut takes O(log n) templatings: fewer messages
    never make a longer prompt."""
    try:
        return _templated(services, call, model, chat, tool_choice, body, max_output_tokens), 0
    except ContextLengthExceededError as exc:
        frontend = services.catalog.frontend(model)
        if body.truncation != "auto" or frontend is None or len(chat.messages) < 2:
            raise _naming_input(exc) from None
        error = exc
    messages = chat.messages
    first = 1 if messages[0]["role"] == "system" and body.instructions else 0
    window = frontend.max_model_len
    reserve = max_output_tokens or 1

    def kept(num_dropped: int) -> list[dict]:
        start = first + num_dropped
        while start < len(messages) - 1 and messages[start]["role"] == "tool":
            start += 1
        return messages[:first] + messages[start:]

    def fits(num_dropped: int) -> bool:
        try:
            prompt = template_chat(frontend, kept(num_dropped), chat.tools, tool_choice, body.parallel_tool_calls,
                                   chat.response_format, services.tool_parser(frontend),
                                   reasoning_parser=reasoning_parser(services, frontend), thinking=body.thinking())
        except ContextLengthExceededError:
            return False
        return len(prompt.prompt_token_ids) + reserve <= window

    low, high = 1, len(messages) - 1 - first  # fits(high) or nothing does: only the last message is left
    if high < low or not fits(high):
        raise _naming_input(error)
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    truncated = ChatInput(kept(low), chat.tools, chat.response_format)
    try:
        return _templated(services, call, model, truncated, tool_choice, body, max_output_tokens), low
    except ContextLengthExceededError as exc:
        raise _naming_input(exc) from None


def _templated(services: Services, call: Call, model: str, chat: ChatInput, tool_choice: Any, body: ResponsesPrompt,
               max_output_tokens: int | None) -> ChatTemplating:
    return chat_prompt(services, call, model, chat, tool_choice, max_output_tokens, "max_output_tokens",
                       len(chat.messages), body.parallel_tool_calls, thinking=body.thinking())


# The chat path's request fields a refusal names, as the Responses API names them.
CHAT_TO_RESPONSES_PARAM = {"messages": "input", "response_format": "text.format", "tools": "tools"}


def naming_fields(exc: ContentPolicyViolationError) -> ContentPolicyViolationError:
    """The safety stage's refusal (its input check's, a guard model's), naming the Responses
    field the finding is in: input, not messages."""
    param = CHAT_TO_RESPONSES_PARAM.get(exc.param or "")
    return exc if param is None or param == exc.param else ContentPolicyViolationError(exc.categories, param=param)


def _naming_input(exc: ContextLengthExceededError) -> ContextLengthExceededError:
    """The chat path's context-length 400, naming the Responses field: input, not messages."""
    if exc.prompt != "messages":
        return exc
    param = "input" if exc.param in ("messages", None) else exc.param
    return ContextLengthExceededError(exc.num_prompt_tokens, exc.max_tokens, exc.max_model_len, param=param,
                                      prompt="input")
