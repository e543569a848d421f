"""The tools of an Anthropic Messages request (anthropic/types/tool_union_param.py) and its
tool_choice, as the chat templates take them.

    custom tool (no type, or "custom")      -> a function with the caller's input_schema
    bash_*, text_editor_*, memory_*         -> Anthropic-defined client tools: the caller runs them,
                                               the model gets their documented input schema
    web_search_*, web_fetch_*, code_execution_*, tool_search_tool_*, advisor_*, *_toolset*
    (mcp_toolset too), computer_*           -> left out of what the model sees (ServerTool), as the
                                               Responses API leaves out OpenAI's built-in tools:
                                               agents list them beside their client tools. Server
                                               tools run on Anthropic's side; the computer tool
                                               acts on screenshots a text-only model cannot read.
                                               A tool_choice naming one is a 400 (anthropic.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator

from tokenway.protocol.anthropic_blocks import CacheControl
from tokenway.protocol.errors import short_repr
from tokenway.protocol.openai_messages import TaggedUnion, WireModel, check_json_schema, fail

_BASH = {
    "description": "Run commands in a bash shell. The shell's state (working directory, variables) persists "
                   "between calls. Long outputs are truncated.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The bash command to run. Required unless the tool is being "
                                                     "restarted."},
        "restart": {"type": "boolean", "description": "Specifying true will restart this tool. Otherwise, leave "
                                                      "this unspecified."}}},
}


def _editor(commands: tuple[str, ...]) -> dict[str, Any]:
    return {
        "description": "View, create and edit text files. `view` shows a file with line numbers (or lists a "
                       "directory); `create` writes a new file; `str_replace` replaces old_str, which must occur "
                       "exactly once, with new_str; `insert` puts new_str after line insert_line (0: the start)"
                       + ("; `undo_edit` reverts the last edit of path." if "undo_edit" in commands else "."),
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": list(commands)},
            "path": {"type": "string", "description": "Absolute path to the file or directory."},
            "file_text": {"type": "string", "description": "The content of the file to create."},
            "old_str": {"type": "string", "description": "The text to replace, exactly as in the file."},
            "new_str": {"type": "string", "description": "The new text (str_replace, insert)."},
            "insert_line": {"type": "integer", "description": "The line after which new_str is inserted."},
            "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                           "description": "[start, end] lines to view, 1-based; end -1 reads to the end."}},
            "required": ["command", "path"]},
    }


_MEMORY = {
    "description": "A directory of memory files (/memories) kept across conversations: view, create, "
                   "str_replace, insert, delete or rename files there. Check it before starting a task.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
        "path": {"type": "string"}, "view_range": {"type": "array", "items": {"type": "integer"}},
        "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
        "insert_line": {"type": "integer"}, "insert_text": {"type": "string"},
        "old_path": {"type": "string"}, "new_path": {"type": "string"}},
        "required": ["command"]},
}

_EDITOR_V1 = _editor(("view", "create", "str_replace", "insert", "undo_edit"))
_EDITOR_V2 = _editor(("view", "create", "str_replace", "insert"))  # Claude 4's editor has no undo_edit
# Anthropic-defined client tools: type -> (the name the type fixes, its description and schema).
CLIENT_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "bash_20241022": ("bash", _BASH),
    "bash_20250124": ("bash", _BASH),
    "text_editor_20241022": ("str_replace_editor", _EDITOR_V1),
    "text_editor_20250124": ("str_replace_editor", _EDITOR_V1),
    "text_editor_20250429": ("str_replace_based_edit_tool", _EDITOR_V2),
    "text_editor_20250728": ("str_replace_based_edit_tool", _EDITOR_V2),
    "memory_20250818": ("memory", _MEMORY),
}
# Types the model is not shown: Anthropic's server tools (the toolsets by "_toolset" anywhere in
# the type), and the computer tool.
_SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "advisor_")
_COMPUTER_PREFIX = "computer_"


def left_out(kind: str) -> bool:
    """Whether a tool of this type is left out of what the model sees (a ServerTool)."""
    return kind.startswith((*_SERVER_TOOL_PREFIXES, _COMPUTER_PREFIX)) or "_toolset" in kind


class CustomTool(WireModel):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    input_examples: list[dict[str, Any]] | None = None
    cache_control: CacheControl | None = None
    # Accepted, nothing to change: calls are held to the schema wherever the tool format allows
    # (docs/api.md, Tools); every tool is in the prompt (there is no tool search to defer to);
    # only the model calls tools here; input streams as it is written.
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(value, object_root=True)

    def chat_tool(self) -> dict[str, Any]:
        description = self.description or ""
        if self.input_examples:  # Anthropic shows them to the model with the tool
            examples = "\n".join(json.dumps(example, ensure_ascii=False) for example in self.input_examples)
            description = f"{description}\n\nExample inputs:\n{examples}".strip()
        return {"type": "function", "function": {"name": self.name, "parameters": self.input_schema,
                                                 **({"description": description} if description else {})}}


class ClientTool(WireModel):
    """An Anthropic-defined tool the caller runs (bash, the text editor, memory): its type fixes
    its name and its input schema."""

    type: str
    name: str
    cache_control: CacheControl | None = None
    max_characters: int | None = None  # the caller's own cut of what `view` returns
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    input_examples: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _name_fits_type(self) -> ClientTool:
        expected = CLIENT_TOOLS[self.type][0] if self.type in CLIENT_TOOLS else None
        if expected is None:
            raise fail("tool_type", "type must be one of {expected}, got {got}",
                       expected=", ".join(repr(k) for k in CLIENT_TOOLS), got=short_repr(self.type))
        if self.name != expected:
            raise fail("tool_name", "a {kind} tool is named {expected}, got {got}", kind=self.type,
                       expected=repr(expected), got=short_repr(self.name))
        return self

    def chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, **CLIENT_TOOLS[self.type][1]}}


class ServerTool(WireModel):
    """A tool the model is not shown (left_out): its type is named in the response's
    x-tokenway-omitted-tools header and the trace; its other fields are not read."""

    type: str
    name: str | None = None  # a toolset has none (mcp_toolset names its server instead)
    cache_control: CacheControl | None = None  # still a breakpoint: the prompt's prefix ends there


def _tool_kind(value: Any) -> Any:
    if not isinstance(value, dict):
        raise fail("object_type", "each tool must be a JSON object, got {got}", got=short_repr(value))
    kind = value.get("type")
    if kind is None or kind == "custom" or kind in CLIENT_TOOLS:
        return value
    if not isinstance(kind, str):
        raise fail("tool_type", "type must be a string, got {got}", got=short_repr(kind))
    if left_out(kind):
        return value
    raise fail("tool_type", "type must be 'custom' (or absent), one of {expected}, or one of Anthropic's server "
               "tools (which this server leaves out of the prompt), got {got}",
               expected=", ".join(repr(k) for k in CLIENT_TOOLS), got=short_repr(kind))


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in (None, "custom"):  # CamelCase: left out of an error's param
        return "CustomTool"
    return "ClientTool" if kind in CLIENT_TOOLS else "ServerTool"


Tool = Annotated[Annotated[CustomTool, Tag("CustomTool")] | Annotated[ClientTool, Tag("ClientTool")]
                 | Annotated[ServerTool, Tag("ServerTool")], Discriminator(_tool_tag), BeforeValidator(_tool_kind)]


def shown_tools(tools: list[Any] | None) -> list[CustomTool | ClientTool]:
    """The tools the model sees, in order."""
    return [tool for tool in tools or () if not isinstance(tool, ServerTool)]


def omitted_tools(tools: list[Any] | None) -> tuple[str, ...]:
    """The types of the tools left out, each once, in order (GenerationJob's omitted_tools)."""
    return tuple(dict.fromkeys(tool.type for tool in tools or () if isinstance(tool, ServerTool)))


# ---- tool_choice --------------------------------------------------------------------------------


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


def check_tool_choice(choice: ToolChoice | None, tools: list[Any] | None) -> ToolChoice | None:
    """tool_choice, if it names a tool the model is shown, or asks for any where one is."""
    names = [tool.name for tool in shown_tools(tools)]
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        kind = next((tool.type for tool in tools or () if isinstance(tool, ServerTool) and tool.name == choice.name),
                    None)
        if kind is not None and kind.startswith(_COMPUTER_PREFIX):  # listed, it is left out; forced, it fails
            raise fail("unsupported_tool", "names tool {name}, a {kind} tool, which this server leaves out of the "
                       "prompt: it acts on screenshots, which this text-only model cannot read",
                       name=short_repr(choice.name), kind=kind)
        if kind is not None:
            raise fail("unsupported_tool", "names tool {name}, a {kind} server tool, which this server leaves out of "
                       "the prompt: Anthropic's servers run it and this one does not; define it as a custom tool "
                       "(name, input_schema) and run it client-side", name=short_repr(choice.name), kind=kind)
        raise fail("tool_choice", "names tool {name}, which is not in tools", name=short_repr(choice.name))
    if isinstance(choice, ToolChoiceAny) and not names:
        if tools:
            raise fail("tool_choice", "'any' needs a client tool in tools; those listed ({kinds}) are left out of "
                       "the prompt, as tools this server cannot give the model", kinds=", ".join(omitted_tools(tools)))
        raise fail("tool_choice", "'any' needs at least one tool in tools")
    return choice


def chat_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any]:
    """tool_choice as the chat templates take it (OpenAI's)."""
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required", "none": "none"}.get(choice.type if choice is not None else "auto", "auto")
