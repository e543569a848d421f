"""The adaptor for Anthropic's Messages API: a body becomes the same PreparedCall a chat call
makes (server/prepare.py's steps), and POST /v1/messages/count_tokens counts the prompt it
would make.

    MessagesRequest ─► chat_conversation (protocol/anthropic.py) ─► context edits
        (anthropic_context.py) ─► screen ─► chat_prompt (thinking, the reply's format)
        ─► SamplingParams ─► GenerationJob ─► prepared() ─► MessagesCall
    MessagesPrompt ─► the same conversation and edits ─► the templated prompt's length

Where the model is tokenway's own, max_tokens past what the window leaves is cut to fit, as
Anthropic's current models do: a reply that reaches the window stops with
model_context_window_exceeded, not a 400 up front (agent clients ask for 32k tokens of any model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from tokenway.frontend.model import ModelFrontend
from tokenway.frontend.templating import template_chat, templated_token_ids
from tokenway.gateway.call import Call
from tokenway.gateway.tiers import anthropic_ask
from tokenway.protocol.anthropic import MessagesPrompt, MessagesRequest, chat_conversation, to_chat_tools
from tokenway.protocol.anthropic_bodies import AppliedEdit, MessageTokensCount
from tokenway.protocol.anthropic_edits import ClearThinking, ClearToolUses
from tokenway.protocol.anthropic_tools import chat_tool_choice
from tokenway.protocol.errors import ContextLengthExceededError
from tokenway.protocol.job import GenerationJob, estimate_chat_tokens
from tokenway.protocol.sampling import SamplingParams, ThinkingRequest
from tokenway.safety.channels import ChatInput, screen_chat
from tokenway.server.anthropic_context import apply_edits
from tokenway.server.prepare import (
    ChatTemplating,
    PreparedCall,
    chat_prompt,
    field_errors,
    prepared,
    reasoning_parser,
    route,
    screen,
    service_class,
)
from tokenway.server.services import Services


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """What prepare_messages made of a body: the call, and what rendering its reply needs."""

    prepared: PreparedCall
    num_breakpoint_tokens: int  # the prompt's tokens up to its last cache_control breakpoint (0: none)
    cache_ttl: Literal["5m", "1h"]  # the last breakpoint's
    thinking_shown: bool  # False: thinking blocks come without their text (display "omitted")
    window_bound: bool  # the window left less room than max_tokens: a reply cut there stopped for the window
    prewarm: bool  # max_tokens 0: the prompt fills the cache, the reply is not shown
    applied_edits: list[AppliedEdit] | None  # None: the call asked for no context edits
    speed_asked: bool


@dataclass(frozen=True, slots=True)
class MessagesInput:
    """A body's conversation as the template takes it, edited, before the safety stage."""

    chat: ChatInput
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool | None  # False: disable_parallel_tool_use
    thinking: ThinkingRequest | None
    num_cached_messages: int  # the chat messages up to the last cache breakpoint
    cache_ttl: Literal["5m", "1h"]
    applied_edits: list[AppliedEdit] | None
    num_original_tokens: int | None  # the prompt's tokens before the edits, where any were asked


def messages_input(services: Services, model: str, body: MessagesPrompt) -> MessagesInput:
    conversation = chat_conversation(body)
    tools = to_chat_tools(body)
    tool_choice = chat_tool_choice(body.tool_choice) if tools else "auto"
    parallel = False if getattr(body.tool_choice, "disable_parallel_tool_use", None) else None
    response_format = body.response_format()
    thinking = body.thinking_request()
    messages, applied, num_original_tokens = conversation.messages, None, None
    if body.context_management is not None:
        edits = [edit for edit in body.context_management.edits or ()
                 if isinstance(edit, ClearToolUses | ClearThinking)]  # the schema refuses the others
        count = partial(_count_tokens, services, model, tools, response_format, tool_choice, parallel, thinking)
        messages, applied, num_original_tokens = apply_edits(edits, messages, count) if edits else (messages, [], None)
    return MessagesInput(ChatInput(messages, tools, response_format), tool_choice, parallel, thinking,
                         conversation.num_cached_messages, conversation.cache_ttl, applied, num_original_tokens)


def _count_tokens(services: Services, model: str, tools: list[dict[str, Any]] | None,
                  response_format: dict[str, Any] | None, tool_choice: Any, parallel: bool | None,
                  thinking: ThinkingRequest | None, messages: list[dict[str, Any]]) -> int:
    """A conversation's prompt length, past the window too (what an edit is for)."""
    frontend = services.catalog.frontend(model)
    if frontend is None:
        return estimate_chat_tokens(messages, tools)
    with field_errors():
        return len(templated_token_ids(frontend, messages, tools, tool_choice, parallel, response_format,
                                       services.tool_parser(frontend), window_limit=False, thinking=thinking))


def prepare_messages(services: Services, body: MessagesRequest, call: Call) -> MessagesCall:
    """The adaptor for Messages: the body becomes one GenerationJob."""
    model = route(services, call, body.model)
    tier = service_class(services, call, anthropic_ask(body.service_tier))
    policy = services.safety_policy(model, call.start.principal)
    frontend = services.catalog.frontend(model)
    prompt = messages_input(services, model, body)
    chat = screen_chat(partial(screen, call, policy), prompt.chat)
    gatekeeper = services.gatekeeper
    if frontend is not None and gatekeeper is not None:  # the key's cap on max_tokens, as sent
        gatekeeper.check_sizes(call.start.principal, len(body.messages), body.max_tokens, "max_tokens")
    max_tokens = max(1, body.max_tokens)  # a prewarm's one token is not shown
    # A last assistant message is Anthropic's prefill: the reply goes on from it.
    with field_errors():
        templating = chat_prompt(services, call, model, chat, prompt.tool_choice,
                                 max_tokens if frontend is None else None, "max_tokens", len(body.messages),
                                 prompt.parallel_tool_calls, continue_final_message=chat.messages[-1]["role"] ==
                                 "assistant", thinking=prompt.thinking)
        window_bound = templating.max_tokens is not None and templating.max_tokens < max_tokens
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            max_tokens=min(max_tokens, templating.max_tokens or max_tokens),
            stop=tuple(s for s in (body.stop_sequences or ()) if s), structured_output=templating.structured,
            skip_special_tokens=templating.skip_special_tokens, reasoning_budget=templating.reasoning_budget)
    job = GenerationJob(call.start.new_id("msg_"), model, "chat", params, messages=templating.messages,
                        tools=tuple(chat.tools) if chat.tools else None, omitted_tools=body.omitted_tools(),
                        tool_choice=prompt.tool_choice,
                        parallel_tool_calls=prompt.parallel_tool_calls is None, response_format=chat.response_format,
                        prompt_token_ids=templating.prompt_token_ids, context_window=templating.context_window,
                        stream=bool(body.stream), thinking=prompt.thinking, service_class=tier)
    reply_format = templating.reply_format and dataclasses.replace(templating.reply_format, id_prefix="toolu_")
    num_breakpoint_tokens = 0  # counted before prepared() ends the tokenize stage's clock
    if frontend is not None and prompt.num_cached_messages and templating.prompt_token_ids is not None:
        num_breakpoint_tokens = breakpoint_tokens(services, frontend, chat, prompt, templating)
    return MessagesCall(prepared(services, call, job, frontend, policy, reply_format, reasoning=templating.reasoning),
                        num_breakpoint_tokens, prompt.cache_ttl, body.thinking_shown, window_bound,
                        body.max_tokens == 0, prompt.applied_edits, body.speed is not None)


def breakpoint_tokens(services: Services, frontend: ModelFrontend, chat: ChatInput, prompt: MessagesInput,
                      templating: ChatTemplating) -> int:
    """The prompt's tokens up to the end of the message holding the last cache breakpoint: its
    prefix in common with that conversation cut there (a template may render a turn otherwise
    once later turns follow it, so the common part is what the cache holds)."""
    assert templating.prompt_token_ids is not None, "only a templated prompt has tokens to count"
    full = templating.prompt_token_ids
    cut = chat.messages[:prompt.num_cached_messages]
    if len(cut) == len(chat.messages):
        return len(full)
    try:
        prefix = _templated(services, frontend, chat, prompt, cut, continue_final_message=True)
    except ValueError:  # the template does not write the last message's text as sent
        try:
            prefix = _templated(services, frontend, chat, prompt, cut, continue_final_message=False)
        except ValueError:  # a cut no template takes (it would have been the call's own 400): none written
            return 0
    return common_prefix_length(full, prefix)


def _templated(services: Services, frontend: ModelFrontend, chat: ChatInput, prompt: MessagesInput,
               messages: list[dict[str, Any]], continue_final_message: bool) -> list[int]:
    return template_chat(frontend, messages, chat.tools, prompt.tool_choice, prompt.parallel_tool_calls,
                         chat.response_format, services.tool_parser(frontend), continue_final_message,
                         reasoning_parser=reasoning_parser(services, frontend),
                         thinking=prompt.thinking).prompt_token_ids


def common_prefix_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many leading ids a and b share (a binary search of C-speed slice compares: a long
    prompt's ids are not walked one by one in Python)."""
    low, high = 0, min(len(a), len(b))
    a, b = list(a), list(b)
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def count_message_tokens(services: Services, body: MessagesPrompt, call: Call) -> MessageTokensCount:
    """POST /v1/messages/count_tokens: the prompt's length as a Messages call with this body
    would have it (its usage's input_tokens + cache_creation_input_tokens +
    cache_read_input_tokens), past the window too; an estimate for a model tokenway has no
    tokenizer for. The safety stage does not read it: nothing is sent to a model."""
    model = route(services, call, body.model)
    prompt = messages_input(services, model, body)
    chat = prompt.chat
    try:
        with field_errors():
            templating = chat_prompt(services, call, model, chat, prompt.tool_choice, None, "max_tokens",
                                     len(body.messages), prompt.parallel_tool_calls,
                                     continue_final_message=chat.messages[-1]["role"] == "assistant",
                                     thinking=prompt.thinking)
        token_ids = templating.prompt_token_ids
        num_tokens = len(token_ids) if token_ids is not None else estimate_chat_tokens(chat.messages, chat.tools)
    except ContextLengthExceededError:  # an agent counts to learn that a conversation no longer fits
        num_tokens = _count_tokens(services, model, chat.tools, chat.response_format, prompt.tool_choice,
                                   prompt.parallel_tool_calls, prompt.thinking, chat.messages)
    counted: MessageTokensCount = {"input_tokens": num_tokens}
    if prompt.applied_edits is not None:
        counted["context_management"] = {"original_input_tokens": prompt.num_original_tokens or num_tokens}
    return counted
