"""The items of a Responses `input` (and of a stored conversation): what a client may send, each
parsed at the edge into its pydantic model and made, once, into the plain item the server
stores, lists and translates (protocol/responses_bodies.py's TypedDicts, each with its id):

    {"role": "user", "content": "hi"}        MessageInput   ─► InputMessageItem (input_text parts)
    {"type": "message", "role": "assistant"} MessageInput   ─► OutputMessageItem (output_text parts)
    {"type": "function_call", ...}            FunctionCallInput ─► FunctionCallItem
    {"type": "function_call_output", ...}     FunctionCallOutputInput ─► FunctionCallOutputItem
    {"type": "reasoning", ...}                ReasoningInput ─► ReasoningItem

A reasoning item's thinking (reasoning_text) is the model's own text, and goes back into the
prompt as its turn's reasoning_content (what a template that thinks renders). Its
encrypted_content, where tokenway made it, holds that same text in an envelope
(reasoning_envelope): tokenway keeps no secret to encrypt with and its thinking is shown in
content anyway, so the envelope hides nothing; it is there so that a client that passes back
only encrypted_content (as clients of OpenAI's stateless mode may) still hands the thinking
back. Another server's encrypted_content cannot be read here: its item stays in the
conversation, out of the prompt.

A hosted tool's item (web_search_call, ...), an item_reference, and image, file or audio parts
are a 400 naming them.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from tokenway.protocol.errors import short_repr
from tokenway.protocol.openai_messages import TaggedUnion, WireModel, fail
from tokenway.protocol.responses_bodies import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessageItem,
    OutputMessageItem,
    OutputText,
    ReasoningItem,
)

TEXT_ONLY = frozenset({"input_image", "input_file", "input_audio", "image_url"})
# The items OpenAI's hosted tools leave in a conversation: named in the 400.
BUILTIN_ITEMS = frozenset({
    "file_search_call", "computer_call", "computer_call_output", "web_search_call", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output", "tool_search_call",
    "tool_search_output", "additional_tools", "configuration_update", "compaction", "compaction_trigger",
    "program", "program_output",
})

NewId = Callable[[str], str]  # prefix -> a fresh id ("msg_" -> "msg_3f9c...")


class InputTextPart(WireModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(WireModel):  # an assistant message the client passes back
    type: Literal["output_text"]
    text: str


class RefusalPart(WireModel):
    type: Literal["refusal"]
    refusal: str


def string_type(value: Any) -> Any:
    """An object whose "type" is not a string is refused here: a union picks its member by that
    type, and a list or an object cannot name one."""
    if isinstance(value, dict) and not isinstance(value.get("type", ""), str):
        raise fail("unknown_type", "type must be a string, got {got}", got=short_repr(value["type"]))
    return value


ContentPart = Annotated[
    Annotated[InputTextPart | OutputTextPart | RefusalPart, TaggedUnion("content part", text_only=TEXT_ONLY)],
    BeforeValidator(string_type)]


def _text_of(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.refusal if isinstance(part, RefusalPart) else part.text for part in content)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageInput(WireModel):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    def item(self, new_id: NewId) -> InputItem:
        text = _text_of(self.content)
        if self.role == "assistant":
            part: OutputText = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            output: OutputMessageItem = {"id": self.id or new_id("msg_"), "type": "message", "role": "assistant",
                                         "status": self.status or "completed", "content": [part]}
            return output
        message: InputMessageItem = {"id": self.id or new_id("msg_"), "type": "message", "role": self.role,
                                     "status": self.status or "completed",
                                     "content": [{"type": "input_text", "text": text}]}
        return message


class FunctionCallInput(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # the namespace tool the function is in
    id: str | None = None
    status: ItemStatus | None = None

    def item(self, new_id: NewId) -> FunctionCallItem:
        item: FunctionCallItem = {"id": self.id or new_id("fc_"), "type": "function_call", "call_id": self.call_id,
                                  "name": self.name, "arguments": self.arguments, "status": self.status or "completed"}
        if self.namespace is not None:
            item["namespace"] = self.namespace
        return item


class FunctionCallOutputInput(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    def item(self, new_id: NewId) -> FunctionCallOutputItem:
        return {"id": self.id or new_id("fco_"), "type": "function_call_output", "call_id": self.call_id,
                "output": _text_of(self.output), "status": self.status or "completed"}


class SummaryText(WireModel):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(WireModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningInput(WireModel):
    """A reasoning model's earlier thinking, passed back: its text (content, or tokenway's
    envelope) goes into the prompt with the turn it preceded."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None

    def item(self, new_id: NewId) -> ReasoningItem:
        return {"id": self.id or new_id("rs_"), "type": "reasoning",
                "summary": [{"type": "summary_text", "text": part.text} for part in self.summary],
                "content": [{"type": "reasoning_text", "text": part.text} for part in self.content or ()],
                "encrypted_content": self.encrypted_content, "status": self.status or "completed"}


ENVELOPE_PREFIX = "tokenway.reasoning.v1:"


def reasoning_envelope(text: str) -> str:
    """The thinking as a reasoning item's encrypted_content: base64 of its UTF-8, marked as
    tokenway's (the module's docstring says why it is not encrypted)."""
    return ENVELOPE_PREFIX + base64.urlsafe_b64encode(text.encode()).decode("ascii")


def reasoning_text(item: ReasoningItem) -> str:
    """The thinking a reasoning item holds: its reasoning_text parts, else the text in
    tokenway's envelope; "" for another server's encrypted_content, or an item of summaries only
    (a summary is not the thinking its model would read back)."""
    texts = [part["text"] for part in item.get("content") or ()]
    if texts:
        return "".join(texts)
    sealed = item.get("encrypted_content")
    if sealed is None or not sealed.startswith(ENVELOPE_PREFIX):
        return ""
    try:
        return base64.urlsafe_b64decode(sealed.removeprefix(ENVELOPE_PREFIX).encode("ascii")).decode()
    except (ValueError, UnicodeError):  # binascii.Error is a ValueError
        return ""


def _item_kind(value: Any) -> Any:
    """An item without a type is a message (OpenAI's EasyInputMessage); a hosted tool's item
    or a reference is refused by name before the union reports every member's complaint."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    kind = string_type(value).get("type") if isinstance(value, dict) else None
    if kind in BUILTIN_ITEMS:
        raise fail("unsupported_item", "item type {got} comes from a built-in tool, which this server does not "
                   "run (it runs function tools only)", got=short_repr(kind))
    if kind == "item_reference":
        raise fail("unsupported_item", "item_reference is not supported by this server: send the item itself, "
                   "or continue a stored response with previous_response_id")
    return value


InputItemModel = Annotated[
    Annotated[MessageInput | FunctionCallInput | FunctionCallOutputInput | ReasoningInput,
              TaggedUnion("input item", text_only=TEXT_ONLY)],
    BeforeValidator(_item_kind)]
