"""gpt-oss's Harmony format: a chat call's prompt rendered as Harmony, as openai-harmony renders it
(the model's own chat template is not used: it differs from the library in places, and the
library is what gpt-oss was trained on). The reply is read by harmony_parser.py.

    <|start|>system<|message|>{identity}                            tokenway writes this message:
    Knowledge cutoff: 2024-06                                        the effort from the call's
    Current date: 2026-12-02                                         ThinkingRequest (or the
                                                                     template kwarg reasoning_effort)
    Reasoning: medium

    # Valid channels: analysis, commentary, final. Channel must be included for every message.
    Calls to these tools must go to the commentary channel: 'functions'.<|end|>
    <|start|>developer<|message|># Instructions                     the caller's leading system /
                                                                     developer messages, then the
    {instructions}                                                   tools (harmony_typescript.py)

    # Tools

    ## functions

    namespace functions {

    // {description}
    type get_weather = (_: {
    city: string,
    }) => any;

    } // namespace functions<|end|>
    <|start|>user<|message|>What's the weather?<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning passed back}<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}<|call|>
    <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny":true}<|end|>
    <|start|>assistant                                               the generation prompt

An assistant turn becomes its analysis (reasoning_content), a commentary preamble (content
beside calls), each call, or its final answer (content). Analysis is dropped as openai-harmony
drops it: when the last assistant message is a final answer, every analysis before the first
final answer goes (a turn still calling tools keeps its thinking).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tokenway.frontend.harmony_typescript import schema_type
from tokenway.protocol.sampling import EFFORT_BUDGETS, ThinkingRequest

HARMONY = "harmony"  # the reply format's name (ReplyFormat.tool_format) and the reasoning format's
EFFORTS = ("low", "medium", "high")
DEFAULT_EFFORT = "medium"  # openai-harmony's SystemContent default
DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
CHANNELS = ("analysis", "commentary", "final")
# The template variables the official chat template reads that a caller may set
# (chat_template_kwargs), as it names them.
EFFORT_VARIABLE, IDENTITY_VARIABLE = "reasoning_effort", "model_identity"


def is_harmony_template(chat_template: str | None) -> bool:
    """A chat template that writes Harmony (gpt-oss's): its messages are <|start|>..<|message|>
    and carry a <|channel|>."""
    return bool(chat_template) and all(marker in chat_template for marker in ("<|start|>", "<|channel|>",
                                                                              "<|message|>"))


def reasoning_effort(thinking: ThinkingRequest | None, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The `Reasoning:` level a call asks for. A template kwarg reasoning_effort (the official
    template's) wins; else the ThinkingRequest: thinking off is low (gpt-oss always thinks), a
    budget the highest level whose budget (sampling.EFFORT_BUDGETS: OpenAI's efforts, Anthropic's
    budget_tokens) fits in it, low below them all; else medium."""
    asked = (template_kwargs or {}).get(EFFORT_VARIABLE)
    if asked is not None:
        if asked not in EFFORTS:
            raise ValueError(f"chat_template_kwargs.{EFFORT_VARIABLE}: expected one of {', '.join(EFFORTS)}, "
                             f"got {asked!r}")
        return asked
    if thinking is None:
        return DEFAULT_EFFORT
    if thinking.enabled is False or thinking.budget_tokens == 0:
        return "low"
    if thinking.budget_tokens is None:
        return DEFAULT_EFFORT
    fitting = [level for level in EFFORTS if EFFORT_BUDGETS[level] <= thinking.budget_tokens]
    return fitting[-1] if fitting else "low"


@dataclass(frozen=True, slots=True)
class HarmonySystem:
    """What the system message says."""

    reasoning_effort: str = DEFAULT_EFFORT
    current_date: str | None = None  # YYYY-MM-DD; None: no date line
    model_identity: str = DEFAULT_IDENTITY
    knowledge_cutoff: str = KNOWLEDGE_CUTOFF

    def __post_init__(self) -> None:
        if self.reasoning_effort not in EFFORTS:
            raise ValueError(f"reasoning effort {self.reasoning_effort!r}: expected one of {', '.join(EFFORTS)}")

    @classmethod
    def for_call(cls, thinking: ThinkingRequest | None, template_kwargs: Mapping[str, Any] | None = None,
                 today: str | None = None) -> HarmonySystem:
        """The system message for a call: its effort, today's date (UTC, as the official template
        writes the day), the identity a caller's model_identity kwarg sets."""
        identity = (template_kwargs or {}).get(IDENTITY_VARIABLE, DEFAULT_IDENTITY)
        if not isinstance(identity, str):
            raise ValueError(f"chat_template_kwargs.{IDENTITY_VARIABLE}: must be a string")
        return cls(reasoning_effort(thinking, template_kwargs),
                   today if today is not None else datetime.now(UTC).strftime("%Y-%m-%d"), identity)


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    """One message as Harmony renders it: `<|start|>{author}[ to={recipient}][<|channel|>{channel}]
    [ {content_type}]<|message|>{text}<|end|>` (<|call|> for an assistant's message to a tool)."""

    author: str  # a role, or a tool's name (functions.get_weather)
    text: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    def render(self) -> str:
        header = self.author + (f" to={self.recipient}" if self.recipient and self.recipient != "all" else "")
        if self.channel is not None:
            header += f"<|channel|>{self.channel}"
        if self.content_type is not None:
            header += f" {self.content_type}"
        end = "<|call|>" if self.author == "assistant" and self.recipient is not None else "<|end|>"
        return f"<|start|>{header}<|message|>{self.text}{end}"


def render_prompt(messages: list[dict], tools: list[dict] | None, system: HarmonySystem,
                  continue_final_message: bool = False) -> str:
    """Chat messages (chat.normalize_messages': text contents, OpenAI's developer role as
    system) and the call's tools as a Harmony prompt, ending in the generation prompt; with
    continue_final_message, in the last (assistant) message's final answer, begun."""
    begun = None
    if continue_final_message and messages and messages[-1].get("role") == "assistant":
        begun, messages = messages[-1].get("content") or "", messages[:-1]
    instructions, conversation = _split_instructions(messages)
    functions = [_function(tool) for tool in tools or ()]
    harmony = [HarmonyMessage("system", _system_text(system, bool(functions)))]
    if instructions or functions:
        harmony.append(HarmonyMessage("developer", _developer_text(instructions, functions)))
    harmony += conversation_messages(conversation)
    text = "".join(message.render() for message in _drop_analysis(harmony))
    if begun is not None:
        return text + f"<|start|>assistant<|channel|>final<|message|>{begun}"
    return text + "<|start|>assistant"


def _split_instructions(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """The caller's leading system messages (the developer's instructions, as the official
    template takes its first; empty ones say nothing), and the conversation after them."""
    position = 0
    while position < len(messages) and messages[position].get("role") in ("system", "developer"):
        position += 1
    texts = [text for i in range(position) if (text := messages[i].get("content"))]
    return ("\n\n".join(texts) if texts else None), messages[position:]


def conversation_messages(messages: list[dict]) -> list[HarmonyMessage]:
    """The conversation's turns as Harmony messages: a tool result is read as from the call its
    tool_call_id names (else the turn's `name`, else the latest call)."""
    call_id_to_name = {call.get("id"): (call.get("function") or {}).get("name", "")
                       for message in messages for call in message.get("tool_calls") or ()}
    harmony: list[HarmonyMessage] = []
    last_call_name = ""
    for message in messages:
        role, text = message.get("role"), message.get("content") or ""
        if role == "assistant":
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if reasoning:
                harmony.append(HarmonyMessage("assistant", reasoning, channel="analysis"))
            calls = message.get("tool_calls") or ()
            if calls and text:  # words beside calls: a preamble, to the user
                harmony.append(HarmonyMessage("assistant", text, channel="commentary"))
            elif text:
                harmony.append(HarmonyMessage("assistant", text, channel="final"))
            for call in calls:
                function = call.get("function") or {}
                last_call_name = function.get("name", "")
                harmony.append(HarmonyMessage("assistant", _arguments_text(function.get("arguments")),
                                              channel="commentary", recipient=f"functions.{last_call_name}",
                                              content_type="json"))
        elif role == "tool":
            name = call_id_to_name.get(message.get("tool_call_id")) or message.get("name") or last_call_name
            harmony.append(HarmonyMessage(f"functions.{name}", text, channel="commentary", recipient="assistant"))
        elif role in ("system", "developer"):  # instructions given mid-conversation
            harmony.append(HarmonyMessage("developer", text))
        else:
            harmony.append(HarmonyMessage("user", text))
    return harmony


def _arguments_text(arguments: Any) -> str:
    """A call's arguments as the model wrote them: the caller's JSON text, or an object as JSON."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def _drop_analysis(messages: list[HarmonyMessage]) -> list[HarmonyMessage]:
    """openai-harmony's auto_drop_analysis: where the last assistant message is a final answer,
    the analysis messages before the first final answer are dropped."""
    assistant = [message for message in messages if message.author == "assistant"]
    if not assistant or assistant[-1].channel != "final":
        return messages
    first_final = next(i for i, message in enumerate(messages) if message.channel == "final")
    return [message for i, message in enumerate(messages) if not (i < first_final and message.channel == "analysis")]


def _function(tool: dict) -> dict:
    return tool.get("function", tool) if isinstance(tool.get("function"), dict) else tool


def _system_text(system: HarmonySystem, has_functions: bool) -> str:
    top = [system.model_identity, f"Knowledge cutoff: {system.knowledge_cutoff}"]
    if system.current_date is not None:
        top.append(f"Current date: {system.current_date}")
    channels = f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return "\n\n".join(("\n".join(top), f"Reasoning: {system.reasoning_effort}", channels))


def _developer_text(instructions: str | None, functions: list[dict]) -> str:
    sections = ["# Instructions", instructions] if instructions is not None else []
    if functions:
        sections.append(tools_section(functions))
    return "\n\n".join(sections)


def tools_section(functions: list[dict]) -> str:
    """The developer message's `# Tools` section: the functions as a TypeScript-like namespace."""
    lines = ["## functions\n", "namespace functions {\n"]
    for function in functions:
        lines += [f"// {line}" for line in _lines(function.get("description") or "")]
        parameters = function.get("parameters")
        signature = f"(_: {schema_type(parameters)})" if parameters is not None else "()"
        lines.append(f"type {function.get('name', '')} = {signature} => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _lines(text: str) -> list[str]:
    """Lines as Rust's str::lines splits them (openai-harmony's): at \n, a trailing \r dropped,
    no empty last line."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]
