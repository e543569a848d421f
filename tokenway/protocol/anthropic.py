"""The Anthropic Messages API's requests (/v1/messages), field for field as the anthropic SDK
names them (anthropic/types/message_create_params.py); what the server sends back is
protocol/anthropic_bodies.py's.

    MessagesRequest ── to_chat_messages / to_chat_tools ──► the OpenAI-style messages and tools
                                                           our chat templates take

Same rules as the OpenAI schemas: unknown top-level fields are a 400, nested unknown keys are
ignored (cache_control, citations), types are strict, images are refused (text-only models).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from tokenway.protocol.errors import short_repr
from tokenway.protocol.openai_messages import (
    MAX_COUNT,
    MAX_STOP_STRINGS,
    PositiveInt,
    Probability,
    RequestModel,
    TaggedUnion,
    WireModel,
    check_json_schema,
    fail,
)

_TEXT_ONLY = frozenset({"image", "document", "search_result"})


class TextBlock(WireModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(WireModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # "toolu_..."
    name: str
    input: dict[str, Any]


ToolResultContent = Annotated[TextBlock, TaggedUnion("tool_result content block", text_only=_TEXT_ONLY)]


class ToolResultBlock(WireModel):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(block.text for block in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock,
                         TaggedUnion("content block", text_only=_TEXT_ONLY)]


class InputMessage(WireModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content")
    @classmethod
    def _blocks_fit_role(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        for block in value if isinstance(value, list) else ():
            misplaced = (
                isinstance(block, ToolUseBlock) and role != "assistant"
                or isinstance(block, ToolResultBlock) and role != "user"
            )
            if misplaced:
                raise fail("block_role", "{kind} blocks are not allowed in {role} messages", kind=block.type, role=role)
        return value


class ToolDefinition(WireModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, bash ...) are not offered

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(value, object_root=True)


class ToolChoiceAuto(WireModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(WireModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(WireModel):
    type: Literal["none"]


class ToolChoiceTool(WireModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceNone | ToolChoiceTool, TaggedUnion("tool_choice")]


class Metadata(WireModel):
    user_id: str | None = None


class MessagesRequest(RequestModel):
    model: str
    max_tokens: PositiveInt
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    temperature: Probability | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None  # 0 disables
    # The same cap as OpenAI's `stop`: every sequence is checked against the text at every token.
    stop_sequences: (Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)]
                     | None) = None
    stream: bool | None = None
    metadata: Metadata | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}: these models do not think
    service_tier: str | None = None  # accepted and ignored
    cache_control: dict[str, Any] | None = None  # accepted and ignored: prefix caching is automatic

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
        names = [tool.name for tool in info.data["tools"] or ()]
        if isinstance(value, ToolChoiceTool) and value.name not in names:
            raise fail("tool_choice", "names tool {name}, which is not in tools", name=short_repr(value.name))
        if isinstance(value, ToolChoiceAny) and not names:
            raise fail("tool_choice", "'any' needs at least one tool in tools")
        return value

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "disabled":
            raise fail("unsupported_parameter", "extended thinking is not supported by this server")
        return value


# ---- MessagesRequest -> chat-template messages -------------------------------------------------


def to_chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """OpenAI-style messages: system first; tool_use blocks become the assistant's tool_calls
    (arguments as JSON text), tool_result blocks become role "tool" messages, in block order."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(block.text for block in req.system)
        messages.append({"role": "system", "content": system})
    for message in req.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            texts = [block.text for block in message.content if isinstance(block, TextBlock)]
            calls = [
                {"id": block.id, "type": "function",
                 "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
                for block in message.content if isinstance(block, ToolUseBlock)
            ]
            assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                assistant["tool_calls"] = calls
            messages.append(assistant)
        else:
            texts = []
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
                else:
                    assert isinstance(block, TextBlock)  # tool_use only in assistant messages (_blocks_fit_role)
                    texts.append(block.text)
            if texts:
                messages.append({"role": message.role, "content": "\n".join(texts)})
    return messages


def to_chat_tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    """The tools in OpenAI's {"type": "function", "function": {...}} shape, or None."""
    if not req.tools or isinstance(req.tool_choice, ToolChoiceNone):
        return None
    return [
        {"type": "function", "function": {"name": tool.name, "parameters": tool.input_schema,
                                          **({"description": tool.description} if tool.description else {})}}
        for tool in req.tools
    ]
