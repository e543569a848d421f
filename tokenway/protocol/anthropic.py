"""The Anthropic Messages API's requests (/v1/messages, /v1/messages/count_tokens), field for
field as the anthropic SDK names them (anthropic/types/message_create_params.py and the beta's);
their blocks are protocol/anthropic_blocks.py's, their tools protocol/anthropic_tools.py's, and
what the server sends back protocol/anthropic_bodies.py's.

    MessagesPrompt (count_tokens) ⊂ MessagesRequest (context_management: protocol/anthropic_edits.py)
        ── chat_conversation / to_chat_tools ──► the OpenAI-style messages and tools our chat
                                                 templates take, and the cache breakpoint
        ── thinking_request / response_format ──► what the call asks of the model's thinking
                                                  and of its reply's shape

Same rules as the OpenAI schemas: unknown top-level fields are a 400, nested unknown keys are
ignored, types are strict. Every field of Anthropic's reference is accepted; the few whose
values no server without Anthropic's infrastructure can honour (MCP servers, threads, server-side
compaction, a tool_choice forcing a server tool) are a 400 naming them; server tools listed
beside client tools are left out of the prompt (anthropic_tools.py). docs/api.md says what each
field does here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from tokenway.protocol.anthropic_blocks import (
    ASSISTANT_ONLY,
    CacheControl,
    ContentBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    has_breakpoint,
)
from tokenway.protocol.anthropic_edits import ContextManagement
from tokenway.protocol.anthropic_tools import (
    Tool,
    ToolChoice,
    ToolChoiceNone,
    check_tool_choice,
    omitted_tools,
    shown_tools,
)
from tokenway.protocol.errors import short_repr
from tokenway.protocol.openai_messages import (
    MAX_COUNT,
    MAX_STOP_STRINGS,
    Probability,
    RequestModel,
    TaggedUnion,
    WireModel,
    check_json_schema,
    fail,
)
from tokenway.protocol.sampling import EFFORT_BUDGETS, ThinkingRequest

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for budget_tokens


class InputMessage(WireModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content")
    @classmethod
    def _blocks_fit_role(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        for block in value if isinstance(value, list) else ():
            if isinstance(block, ASSISTANT_ONLY) and role != "assistant" or (
                    isinstance(block, ToolResultBlock) and role != "user"):
                raise fail("block_role", "{kind} blocks are not allowed in {role} messages",
                           kind=getattr(block, "type", "these"), role=role)
        return value


# ---- thinking and output ------------------------------------------------------------------------


class ThinkingEnabled(WireModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET, le=MAX_COUNT)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(WireModel):
    type: Literal["disabled"]


class ThinkingAdaptive(WireModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingBetweenTools(WireModel):
    type: Literal["between_tools"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools,
                           TaggedUnion("thinking")]


class JSONOutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(value)


class OutputConfig(WireModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


# ---- the requests -------------------------------------------------------------------------------


class MessagesPrompt(RequestModel):
    """The fields that make the prompt: a count_tokens body, and the start of every Messages body."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # a breakpoint on the last block
    context_management: ContextManagement | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed here: the usage says "standard"
    mcp_servers: list[dict[str, Any]] | None = None
    compaction: dict[str, Any] | None = None
    billing_policy: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _contents_not_empty(cls, value: list[InputMessage]) -> list[InputMessage]:
        # Anthropic's own rule: only a last assistant message (the prefill) may be empty.
        for index, message in enumerate(value):
            if not message.content and not (index == len(value) - 1 and message.role == "assistant"):
                raise fail("empty_content", "message {index} has empty content: all messages must have "
                           "non-empty content except for the optional final assistant message", index=index)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:  # the tools failed; that error is the one to report
            return value
        return check_tool_choice(value, info.data["tools"])

    def omitted_tools(self) -> tuple[str, ...]:
        """The tool types left out of the prompt (ServerTool's), for the header and the trace."""
        return omitted_tools(self.tools)

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp_servers(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise fail("mcp_servers", "this server does not connect to MCP servers: run the MCP client on your side "
                       "and pass the servers' tools as custom tools")
        return value

    @field_validator("compaction")
    @classmethod
    def _no_compaction(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise fail("compaction", "server-side compaction is not available on this server; compact client-side "
                       "and send the summary as text")
        return value

    @field_validator("billing_policy")
    @classmethod
    def _bill_the_key(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("bill_to", "self") != "self":
            raise fail("billing_policy", "this server bills the calling key only: bill_to must be 'self', got {got}",
                       got=short_repr(value.get("bill_to")))
        return value

    def response_format(self) -> dict[str, Any] | None:
        """output_config.format as the chat path's response_format."""
        output_format = self.output_config.format if self.output_config is not None else None
        return None if output_format is None else json_schema_format(output_format)

    def thinking_request(self) -> ThinkingRequest | None:
        """What the call asks of the model's thinking: an explicit budget wins; adaptive thinking
        (or none asked, where the model thinks by default) is bounded by output_config.effort
        ("max": unbounded); None: the model's default."""
        effort = self.output_config.effort if self.output_config is not None else None
        budget = EFFORT_BUDGETS.get(effort) if effort is not None else None
        thinking = self.thinking
        if isinstance(thinking, ThinkingDisabled):
            return ThinkingRequest(enabled=False)
        if isinstance(thinking, ThinkingEnabled):
            return ThinkingRequest(enabled=True, budget_tokens=thinking.budget_tokens)
        if thinking is not None:  # adaptive, between_tools: the model decides how much, within the effort
            return ThinkingRequest(enabled=True, budget_tokens=budget)
        return None if budget is None else ThinkingRequest(budget_tokens=budget)

    @property
    def thinking_shown(self) -> bool:
        """Whether replies carry their thinking's text (display "omitted": the blocks come empty)."""
        return getattr(self.thinking, "display", None) != "omitted"


class Metadata(WireModel):
    user_id: str | None = None


class MessagesRequest(MessagesPrompt):
    max_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)]  # 0: fill the prompt cache, generate nothing
    temperature: Probability | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None  # 0 disables
    # The same cap as OpenAI's `stop`: every sequence is checked against the text at every token.
    stop_sequences: (Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)]
                     | None) = None
    stream: bool | None = None
    metadata: Metadata | None = None
    output_format: JSONOutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    service_tier: Literal["auto", "standard_only"] | None = None  # None: auto (gateway/tiers.py)
    # Accepted, no effect on the reply: no tool here uses a container; tokenway keeps no
    # fingerprint of earlier prompts to diagnose; the model runs where this server runs; a
    # refusal here is the safety policy's, which no other model would lift.
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    fallbacks: Any = None
    fallback_credit_token: str | dict[str, Any] | None = None
    thread: dict[str, Any] | None = None

    @field_validator("thread")
    @classmethod
    def _no_thread(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise fail("thread", "this server holds no conversation state for /v1/messages: send the whole "
                       "conversation in messages (or use /v1/responses with previous_response_id)")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _room_for_the_budget(cls, value: int, info: ValidationInfo) -> int:
        thinking = info.data.get("thinking")
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= value:
            raise fail("thinking_budget", "must be greater than thinking.budget_tokens ({budget}), got {got}",
                       budget=thinking.budget_tokens, got=value)
        return value

    @field_validator("output_format")
    @classmethod
    def _one_format(cls, value: JSONOutputFormat | None, info: ValidationInfo) -> JSONOutputFormat | None:
        output_config = info.data.get("output_config")
        if value is not None and output_config is not None and output_config.format is not None:
            raise fail("output_format", "give output_config.format or output_format, not both")
        return value

    def response_format(self) -> dict[str, Any] | None:
        if self.output_format is not None:
            return json_schema_format(self.output_format)
        return super().response_format()


def json_schema_format(output_format: JSONOutputFormat) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format.schema_}}


# ---- MessagesPrompt -> chat-template messages -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatConversation:
    """A body's conversation as the chat templates take it, and where its prompt cache
    breakpoint falls: the chat messages up to the end of the one holding the last breakpoint
    (0: no breakpoint there)."""

    messages: list[dict[str, Any]]
    num_cached_messages: int
    cache_ttl: Literal["5m", "1h"] = "5m"


def chat_conversation(req: MessagesPrompt) -> ChatConversation:
    """OpenAI-style messages: system first; thinking blocks become the assistant's
    reasoning_content, tool_use blocks its tool_calls (arguments as JSON text), tool_result
    blocks role "tool" messages, in block order; every other block its text."""
    messages: list[dict[str, Any]] = []
    num_cached, ttl = 0, None
    breakpoint_tools = any(tool.cache_control is not None for tool in req.tools or ())
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(block.text for block in req.system)
        messages.append({"role": "system", "content": system})
        if breakpoint_tools or not isinstance(req.system, str) and any(b.cache_control for b in req.system):
            num_cached, ttl = 1, _ttl(req.system, req.tools)
    for message in req.messages:
        _add_message(messages, message)
        if not isinstance(message.content, str) and any(has_breakpoint(block) for block in message.content):
            num_cached, ttl = len(messages), _ttl(message.content)
    if req.cache_control is not None:  # Anthropic puts it on the last block
        num_cached, ttl = len(messages), req.cache_control.ttl
    return ChatConversation(messages, num_cached, ttl or "5m")


def _ttl(*groups: Any) -> Literal["5m", "1h"] | None:
    """The TTL of the last breakpoint among the blocks or tools given."""
    found = None
    for group in groups:
        for item in group if isinstance(group, list) else ():
            control = getattr(item, "cache_control", None)
            found = control.ttl or "5m" if control is not None else found
    return found


def _add_message(messages: list[dict[str, Any]], message: InputMessage) -> None:
    if isinstance(message.content, str):
        messages.append({"role": message.role, "content": message.content})
        return
    texts: list[str] = []
    if message.role == "assistant":
        reasoning, calls = [], []
        for block in message.content:
            if isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif not isinstance(block, RedactedThinkingBlock) and (text := block.prompt_text()):
                texts.append(text)
        assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if reasoning:
            assistant["reasoning_content"] = "\n\n".join(reasoning)
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        return
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        elif text := block.prompt_text():
            texts.append(text)
    if texts:
        messages.append({"role": message.role, "content": "\n".join(texts)})


def to_chat_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    return chat_conversation(req).messages


def to_chat_tools(req: MessagesPrompt) -> list[dict[str, Any]] | None:
    """The tools the model is shown, in OpenAI's {"type": "function", "function": {...}} shape,
    or None: server tools are left out (MessagesPrompt.omitted_tools names them)."""
    if isinstance(req.tool_choice, ToolChoiceNone):
        return None
    return [tool.chat_tool() for tool in shown_tools(req.tools)] or None
