"""Chat messages -> prompt token ids, with tools and response formats folded in.

The gateway hands over plain dict messages (already schema-checked); this renders them
with the model's chat template. Tools, in the model's own tool-call format where its
template has one (tool_format(): Hermes/Qwen2.5 <tool_call>, Llama 3.x JSON, Mistral
[TOOL_CALLS]): the template renders the tools, the earlier calls and their results, and the
reply is read by that format's parser (tool_parsers.py); tool_choice "required" or a named
function constrains the reply to the format's calls (tool_grammars.py). A template without
tools gets the generic format (tools.py): the tools in the system prompt, the reply constrained
to its JSON.

A reasoning model (a template that thinks, or serve --reasoning-parser): the call's
ThinkingRequest sets the template's own switch (enable_thinking) and, with a budget, the
engine's ReasoningBudget; the rendered prompt says whether the reply starts inside its thinking
(reasoning_parsers.py reads it).

gpt-oss (a template that writes Harmony): the prompt is rendered by harmony.py, not by its
template, and the reply is read by harmony_parser.py, its thinking, content and calls at once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenway.frontend import special_text
from tokenway.frontend import tools as generic_tools
from tokenway.frontend.harmony import HARMONY, HarmonySystem, is_harmony_template, render_prompt
from tokenway.frontend.harmony_grammar import call_grammar, final_json_grammar
from tokenway.frontend.reasoning_parsers import (
    ReasoningFormat,
    check_reasoning_parser,
    prompt_reasoning,
    template_reasoning_parser,
    thinking_budget,
)
from tokenway.frontend.tokenizer import Tokenizer
from tokenway.frontend.tool_grammars import hermes_auto_grammar, native_call_grammar, qwen3_coder_auto_grammar
from tokenway.frontend.tool_parser_qwen3_coder import writes_qwen3_coder_calls
from tokenway.frontend.tool_parsers import FORMATS, MARKERS, ReplyFormat
from tokenway.protocol.errors import FieldError
from tokenway.protocol.sampling import ReasoningBudget, ThinkingRequest

# What the server hands every template itself: a caller's chat_template_kwargs may not set it.
_SERVER_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                        "unk_token", "pad_token", "raise_exception", "strftime_now"})
# The variable hybrid templates (Qwen3's, SmolLM3's) turn thinking off with.
THINKING_SWITCH = "enable_thinking"


@dataclass(slots=True)
class ChatPrompt:
    prompt_token_ids: list[int]
    # A JSON schema the reply must satisfy (tools or response_format); None: free text.
    json_schema: dict | None = None
    json_object: bool = False
    grammar: str | None = None  # a Lark grammar (llguidance) the reply must match: a native format's calls
    reply_format: ReplyFormat | None = None  # how the reply's tool calls are read; None: no tools
    reasoning: ReasoningFormat | None = None  # how the reply's thinking is read; None: no thinking to read
    reasoning_budget: ReasoningBudget | None = None  # the engine's bound on the thinking; None: unbounded


def text_content(content: Any) -> str:
    """A message's content as text: a string, a list of text parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def normalize_messages(messages: list[dict]) -> list[dict]:
    normalized = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "developer":  # OpenAI's newer name for system
            message["role"] = "system"
        message["content"] = text_content(message.get("content"))
        normalized.append(message)
    return normalized


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + text).strip()
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def tool_format(tokenizer: Tokenizer, override: str | None = None) -> str:
    """The tool-call format for a model: `override` (--tool-parser) where given, else the one
    its chat template renders, else generic."""
    if override is not None:
        if override not in FORMATS:
            raise ValueError(f"tool parser {override!r}: expected one of {', '.join(FORMATS)}")
        return override
    template = tokenizer.chat_template or ""
    if not tokenizer.template_supports_tools:
        return "generic"
    if writes_qwen3_coder_calls(template):  # it holds <tool_call> too
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "generic"


def reasoning_parser_name(tokenizer: Tokenizer, override: str | None = None) -> str | None:
    """The thinking format for a model: `override` (--reasoning-parser) where given, else the
    one its chat template shows; None: the model does not think."""
    if override is not None:
        return check_reasoning_parser(override)
    return None if tokenizer.chat_template_is_fallback else template_reasoning_parser(tokenizer.chat_template)


def template_kwargs_for(tokenizer: Tokenizer, thinking: ThinkingRequest | None,
                        template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The variables a call hands the template beyond the messages: the caller's own (vLLM's
    chat_template_kwargs, which win), and the thinking switch a ThinkingRequest sets where the
    template has one."""
    kwargs: dict[str, Any] = {}
    if thinking is not None and thinking.enabled is not None and THINKING_SWITCH in tokenizer.template_variables:
        kwargs[THINKING_SWITCH] = thinking.enabled
    for key, value in (template_kwargs or {}).items():
        if key in _SERVER_TEMPLATE_VARIABLES:
            raise FieldError("chat_template_kwargs", f"{key!r} is set by the server, not by chat_template_kwargs")
        kwargs[key] = value
    return kwargs


def _reasoning(prompt: ChatPrompt, tokenizer: Tokenizer, name: str, text: str, kwargs: Mapping[str, Any],
               thinking: ThinkingRequest | None, continues: bool) -> None:
    """How the reply's thinking is read, and its budget: none where the template's switch is
    off; a budget of 0 where thinking is asked off and the template has no switch (the engine
    then closes the part at once)."""
    if kwargs.get(THINKING_SWITCH) is False and THINKING_SWITCH in tokenizer.template_variables:
        return
    fmt = prompt.reasoning = prompt_reasoning(name, text, continues)
    if fmt is None or thinking is None:
        return
    budget = 0 if thinking.enabled is False else thinking.budget_tokens
    if budget is not None:
        prompt.reasoning_budget = thinking_budget(fmt, budget, tokenizer.chat_template,
                                                  lambda tag: tokenizer.encode(tag, add_special_tokens=False))


def build_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool | None = None,
    response_format: dict | None = None,
    max_num_tokens: int | None = None,
    tool_parser: str | None = None,
    continue_final_message: bool = False,
    reasoning_parser: str | None = None,
    thinking: ThinkingRequest | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatPrompt:
    """Raises PromptTooLong when the rendered prompt certainly exceeds max_num_tokens.

    continue_final_message: the last message is the start of the assistant's reply (vLLM's
    parameter; Anthropic's prefill), and the reply goes on from its last character.

    parallel_tool_calls None (the caller did not say): several calls a reply in a native
    format; one in the generic format, as llama.cpp does: the models it serves are those
    whose templates know no tools, often small ones, which repeat a call over and over.

    reasoning_parser: the thinking format (--reasoning-parser; None: the template's); thinking:
    what the call asks of it; template_kwargs: the caller's variables for the template."""
    escaped = None
    rendered_tools = tools  # as the template shows them; the constraints are built from `tools` as sent
    kwargs = template_kwargs_for(tokenizer, thinking, template_kwargs)
    if not tokenizer.special_tokens_in_messages:
        (messages, rendered_tools, kwargs), escaped = special_text.escape(tokenizer, [messages, tools, kwargs])
    messages = normalize_messages(messages)
    prompt = ChatPrompt(prompt_token_ids=[])
    if is_harmony_template(tokenizer.chat_template) and not tokenizer.chat_template_is_fallback:
        text = _harmony(prompt, tokenizer, messages, tools, rendered_tools, tool_choice, parallel_tool_calls,
                        response_format, continue_final_message, thinking, kwargs)
        return _encoded(prompt, tokenizer, text, escaped, max_num_tokens)
    fmt = tool_format(tokenizer, tool_parser)
    if parallel_tool_calls is None:
        parallel_tool_calls = fmt != "generic"
    if fmt == "generic":
        messages = generic_tools.render_tool_messages(messages)
    else:
        messages = render_native_messages(messages, fmt)
    template_tools = None
    if tools and tool_choice != "none":
        assert rendered_tools is not None  # escape() hands the values back in their shapes
        if fmt == "generic":
            messages = _with_system(messages, generic_tools.tool_system_prompt(rendered_tools, tool_choice))
            prompt.json_schema = generic_tools.tool_call_schema(tools, tool_choice, parallel_tool_calls)
        else:
            template_tools = [_as_tool(tool) for tool in rendered_tools]
            if tool_choice == "required" or isinstance(tool_choice, dict):
                prompt.grammar = native_call_grammar(tokenizer, fmt, tools, tool_choice, parallel_tool_calls)
            elif fmt == "hermes":
                prompt.grammar = hermes_auto_grammar(tokenizer, tools)
            elif fmt == "qwen3_coder":
                prompt.grammar = qwen3_coder_auto_grammar(tokenizer, tools)
        prompt.reply_format = ReplyFormat(fmt, max_calls=None if parallel_tool_calls else 1,
                                          keeps_special_tokens=_marks_with_special_tokens(tokenizer, fmt),
                                          tools=tuple(tools) if fmt == "qwen3_coder" else ())  # its values' types
    elif response_format is not None:
        kind = response_format.get("type", "text")
        if kind == "json_schema":
            prompt.json_schema = response_format["json_schema"].get("schema") or {}
        elif kind == "json_object":
            prompt.json_object = True
    continues = continue_final_message and bool(messages[-1]["content"])
    if continues:
        text = _continuing(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=template_tools,
                                                         **kwargs), messages[-1]["content"])
    else:  # an empty reply begun is no reply begun
        text = tokenizer.apply_chat_template(messages[:-1] if continue_final_message else messages,
                                             add_generation_prompt=True, tools=template_tools, **kwargs)
    name = reasoning_parser_name(tokenizer, reasoning_parser)
    if name is not None:
        _reasoning(prompt, tokenizer, name, text, kwargs, thinking, continues)
    return _encoded(prompt, tokenizer, text, escaped, max_num_tokens)


def _encoded(prompt: ChatPrompt, tokenizer: Tokenizer, text: str, escaped: special_text.Escaped | None,
             max_num_tokens: int | None) -> ChatPrompt:
    if escaped is None:
        prompt.prompt_token_ids = tokenizer.encode(text, add_special_tokens=False, max_num_tokens=max_num_tokens)
    else:
        prompt.prompt_token_ids = special_text.encode(tokenizer, text, escaped, max_num_tokens)
    return prompt


def _harmony(prompt: ChatPrompt, tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None,
             rendered_tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
             response_format: dict | None, continue_final_message: bool, thinking: ThinkingRequest | None,
             kwargs: Mapping[str, Any]) -> str:
    """A Harmony prompt's text, and how its reply is read: always with special tokens kept (its
    channels are special tokens), calls only where tools are offered (a call to none is read and
    dropped), a grammar where the call forces a tool or a JSON answer."""
    offered = bool(tools) and tool_choice != "none"
    begun = continue_final_message and bool(messages) and messages[-1].get("role") == "assistant"
    continues = begun and bool(messages[-1]["content"])
    if begun and not continues:  # an empty reply begun is no reply begun
        messages = messages[:-1]
    text = render_prompt(messages, rendered_tools if offered else None, HarmonySystem.for_call(thinking, kwargs),
                         continue_final_message=continues)
    prompt.reply_format = ReplyFormat(HARMONY, max_calls=(None if parallel_tool_calls is not False else 1)
                                      if offered else 0, keeps_special_tokens=True)
    prompt.reasoning = ReasoningFormat(HARMONY, "<|channel|>analysis<|message|>", "<|end|>",
                                       open_channel="final" if continues else None)
    if offered and (tool_choice == "required" or isinstance(tool_choice, dict)):
        assert tools is not None  # offered
        prompt.grammar = call_grammar(tokenizer, tools, tool_choice, thinking)
    elif response_format is not None and response_format.get("type") in ("json_schema", "json_object"):
        schema = (response_format.get("json_schema") or {}).get("schema") or {} \
            if response_format["type"] == "json_schema" else {"type": "object"}
        prompt.grammar = final_json_grammar(tokenizer, schema, thinking)
    return text


def _marks_with_special_tokens(tokenizer: Tokenizer, fmt: str) -> bool:
    """Whether a marker of the format is a special (control) token of this tokenizer, which the
    reply's text must then keep for the parser to see (a user-defined one is text anyway)."""
    token_ids = (tokenizer.added_token_id(text) for text in MARKERS[fmt])
    return any(token_id is not None and tokenizer.is_special(token_id) for token_id in token_ids)


def _continuing(text: str, begun: str) -> str:
    """The rendered conversation up to the end of the begun reply: what the template puts after
    the last message (its end-of-turn) is cut off, as transformers' continue_final_message does."""
    for content in (begun, begun.strip()):
        end = text.rfind(content)
        if content and end >= 0:
            return text[:end + len(content)]
    raise FieldError("continue_final_message", "the chat template does not render the last message's text as "
                     "sent, so the reply cannot go on from it")


def _as_tool(tool: dict) -> dict:
    return tool if "function" in tool else {"type": "function", "function": tool}


def render_native_messages(messages: list[dict], fmt: str) -> list[dict]:
    """Earlier calls and results as a template with tools takes them: arguments as objects
    (templates write them with tojson), Mistral's ids as its 9 characters, and for Llama 3.x,
    whose template takes one call a turn, parallel calls as consecutive turns and JSON
    results as objects."""
    rendered = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [_native_call(call, fmt) for call in message["tool_calls"]]
            if fmt == "llama3_json":
                rendered.extend({**message, "content": message["content"] if i == 0 else "", "tool_calls": [call]}
                                for i, call in enumerate(calls))
                continue
            message = {**message, "tool_calls": calls}
        elif message["role"] == "tool" and fmt == "mistral":
            message = {**message, "tool_call_id": mistral_id(message.get("tool_call_id") or "")}
        elif message["role"] == "tool" and fmt == "llama3_json":
            # Llama's template writes any content with tojson (a string is iterable to jinja):
            # a JSON result is handed over parsed, so it reads as JSON, not as a quoted string.
            try:
                value = json.loads(message["content"])
            except json.JSONDecodeError:
                value = None
            if isinstance(value, (dict, list)):
                message = {**message, "content": value}
        rendered.append(message)
    return rendered


def _native_call(call: dict, fmt: str) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            pass  # the template writes it as it is
    call = {**call, "type": "function", "function": function}
    if fmt == "mistral":
        call["id"] = mistral_id(call.get("id") or "")
    return call


def mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates accept it (9 letters and digits); any other id maps
    to one deterministically, so a call and its result keep matching."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(alphabet[b % len(alphabet)] for b in digest[:9])


def schema_text(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))
