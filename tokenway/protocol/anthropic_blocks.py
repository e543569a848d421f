"""The content blocks of an Anthropic Messages request (anthropic/types/content_block_param.py,
and the beta's compaction and MCP blocks), and what each puts into a text-only model's prompt.

    text, document (a text source), search_result, server tool calls and results (a
    conversation begun on Anthropic's API), compaction, mcp_tool_use / _result
                                             -> text in their message, in block order
    thinking                                 -> the assistant turn's reasoning_content
    redacted_thinking, tool_reference        -> nothing (opaque to any model but the one that
                                                made it; every tool is loaded already)
    tool_use / tool_result                   -> the chat format's tool_calls / tool messages
    image, a PDF or file document source     -> 400: the models read text only
    container_upload                         -> 400: no code execution container here

`cache_control` is read on every block that may carry it (a prompt-cache breakpoint, see
server/anthropic_prepare.py); `citations` is accepted and has no effect: the replies carry none.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import field_validator

from tokenway.protocol.openai_messages import TaggedUnion, WireModel, fail

TEXT_ONLY = frozenset({"image"})  # a block type a text-only model cannot read


class CacheControl(WireModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(WireModel):
    def prompt_text(self) -> str:
        """What the block puts into its message's text ("" for nothing)."""
        return ""


class Cacheable(Block):
    """A block that may end a prompt-cache prefix."""

    cache_control: CacheControl | None = None


class TextBlock(Cacheable):
    type: Literal["text"] = "text"
    text: str
    citations: list[Any] | None = None

    def prompt_text(self) -> str:
        return self.text


# ---- documents and search results -------------------------------------------------------------


class PlainTextSource(WireModel):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


SourceContent = Annotated[TextBlock, TaggedUnion("document source content block", text_only=TEXT_ONLY)]


class ContentSource(WireModel):
    type: Literal["content"]
    content: str | list[SourceContent]


# A PDF (base64, url) or a Files API id: pages a text-only model cannot read.
DocumentSource = Annotated[PlainTextSource | ContentSource, TaggedUnion(
    "document source", text_only=frozenset({"base64", "url", "file"}))]


class DocumentBlock(Cacheable):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None

    def prompt_text(self) -> str:
        source = self.source
        if isinstance(source, PlainTextSource):
            body = source.data
        elif isinstance(source.content, str):
            body = source.content
        else:
            body = "\n".join(block.text for block in source.content)
        header = "".join(f"<{name}>{value}</{name}>\n" for name, value in (("title", self.title),
                                                                            ("context", self.context)) if value)
        return f"<document>\n{header}{body}\n</document>"


class SearchResultBlock(Cacheable):
    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: dict[str, Any] | None = None

    def prompt_text(self) -> str:
        body = "\n".join(block.text for block in self.content)
        return f"<search_result>\n<title>{self.title}</title>\n<source>{self.source}</source>\n{body}\n</search_result>"


class ToolReferenceBlock(Cacheable):
    """Tool search's pointer to a deferred tool: every tool is in the prompt here already."""

    type: Literal["tool_reference"]
    tool_name: str


# ---- thinking -----------------------------------------------------------------------------------


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str  # not checked: it vouches for nothing a caller could not write into its prompt anyway


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str  # Anthropic's encrypted thinking: no model here can read it


# ---- tools --------------------------------------------------------------------------------------


class ToolUseBlock(Cacheable):
    type: Literal["tool_use"] = "tool_use"
    id: str  # "toolu_..."
    name: str
    input: dict[str, Any]


ToolResultContent = Annotated[TextBlock | DocumentBlock | SearchResultBlock | ToolReferenceBlock,
                              TaggedUnion("tool_result content block", text_only=TEXT_ONLY)]


class ToolResultBlock(Cacheable):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "\n".join(part for block in self.content if (part := block.prompt_text()))
        return f"Error: {text}" if self.is_error else text


class _ToolCallText(Cacheable):
    """A call Anthropic's servers ran (web search, code execution, an MCP server's tool), in a
    conversation begun there: the model reads what was called as text."""

    id: str
    name: str
    input: dict[str, Any]

    def prompt_text(self) -> str:
        return f"[{self.name}: {json.dumps(self.input, ensure_ascii=False)}]"


class ServerToolUseBlock(_ToolCallText):
    type: Literal["server_tool_use"]


class MCPToolUseBlock(_ToolCallText):
    type: Literal["mcp_tool_use"]
    server_name: str


class ServerToolResult(Cacheable):
    """A server tool's result in a conversation begun on Anthropic's API: its readable fields
    as JSON (encrypted ones, for Anthropic's models only, left out)."""

    kind: ClassVar[str]
    tool_use_id: str
    content: Any = None

    def prompt_text(self) -> str:
        return f"[{self.kind}: {json.dumps(_readable(self.content), ensure_ascii=False)}]"


def _readable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items() if not k.startswith("encrypted_") and k != "cache_control"}
    if isinstance(value, list):
        return [_readable(item) for item in value]
    return value


class WebSearchToolResult(ServerToolResult):
    kind = "web_search_tool_result"
    type: Literal["web_search_tool_result"]


class WebFetchToolResult(ServerToolResult):
    kind = "web_fetch_tool_result"
    type: Literal["web_fetch_tool_result"]


class CodeExecutionToolResult(ServerToolResult):
    kind = "code_execution_tool_result"
    type: Literal["code_execution_tool_result"]


class BashCodeExecutionToolResult(ServerToolResult):
    kind = "bash_code_execution_tool_result"
    type: Literal["bash_code_execution_tool_result"]


class TextEditorCodeExecutionToolResult(ServerToolResult):
    kind = "text_editor_code_execution_tool_result"
    type: Literal["text_editor_code_execution_tool_result"]


class ToolSearchToolResult(ServerToolResult):
    kind = "tool_search_tool_result"
    type: Literal["tool_search_tool_result"]


class MCPToolResultBlock(Cacheable):
    type: Literal["mcp_tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def prompt_text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or ())
        return f"[mcp_tool_result{' (error)' if self.is_error else ''}: {text}]"


class CompactionBlock(Cacheable):
    """A summary of the conversation before it (Anthropic's compaction): read as text."""

    type: Literal["compaction"]
    content: str | None = None

    def prompt_text(self) -> str:
        return self.content or ""


class ContainerUploadBlock(Cacheable):
    type: Literal["container_upload"]
    file_id: str

    @field_validator("file_id")
    @classmethod
    def _no_container(cls, value: str) -> str:
        raise fail("container_upload", "container_upload blocks need a code execution container, which this "
                   "server does not run")


ContentBlock = Annotated[
    TextBlock | DocumentBlock | SearchResultBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock
    | ToolResultBlock | ServerToolUseBlock | WebSearchToolResult | WebFetchToolResult | CodeExecutionToolResult
    | BashCodeExecutionToolResult | TextEditorCodeExecutionToolResult | ToolSearchToolResult | MCPToolUseBlock
    | MCPToolResultBlock | CompactionBlock | ContainerUploadBlock,
    TaggedUnion("content block", text_only=TEXT_ONLY)]

# Blocks only the model writes: they come back in assistant turns.
ASSISTANT_ONLY = (ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, _ToolCallText, ServerToolResult)


def has_breakpoint(block: Any) -> bool:
    """Whether a block (or a tool result's content) carries a cache_control breakpoint."""
    if isinstance(block, Cacheable) and block.cache_control is not None:
        return True
    content = getattr(block, "content", None)
    return isinstance(content, list) and any(has_breakpoint(part) for part in content)
