"""An MCP server's tools as tool-loop Tools, through the official `mcp` SDK (2.x).

    async with mcp_tools(command="python", args=["server.py"]) as tools:      # stdio
        result = await run_tool_loop(chat, request, tools)
    async with mcp_tools(url="http://127.0.0.1:8000/mcp") as tools:           # streamable HTTP
        ...

The session lives as long as the `async with`. Every tool the server lists (all pages)
becomes a schema_tool: its input schema validates the arguments before the call goes out, and
the call's text content (or its structured content, where it has no text) is the result. A
result the server marks as an error reaches the model as the tool's failure. `prefix` names
the tools apart when two servers list the same name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from tokenway.client.tools import Tool, schema_tool


class MCPToolError(RuntimeError):
    """The MCP server answered the call with is_error."""


@asynccontextmanager
async def mcp_tools(*, command: str | None = None, args: Sequence[str] = (), env: dict[str, str] | None = None,
                    cwd: str | None = None, url: str | None = None, headers: dict[str, str] | None = None,
                    prefix: str = "", call_timeout: float | None = 60.0) -> AsyncIterator[list[Tool]]:
    import httpx2
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    if (command is None) == (url is None):
        raise ValueError("mcp_tools: give exactly one of command (stdio) or url (streamable HTTP)")
    async with AsyncExitStack() as stack:
        if url is not None:
            http = await stack.enter_async_context(httpx2.AsyncClient(headers=headers or {}, timeout=call_timeout))
            read, write = await stack.enter_async_context(streamable_http_client(url, http_client=http))
        else:
            assert command is not None  # one of the two, checked above
            params = StdioServerParameters(command=command, args=list(args), env=env, cwd=cwd)
            read, write = await stack.enter_async_context(stdio_client(params))
        session = await stack.enter_async_context(ClientSession(read, write, read_timeout_seconds=call_timeout))
        await session.initialize()
        yield [_as_tool(session, listed, prefix) for listed in await _list_all(session)]


async def _list_all(session: Any) -> list[Any]:
    from mcp.types import PaginatedRequestParams

    listed, cursor = [], None
    while True:
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        listed.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return listed


def _as_tool(session: Any, listed: Any, prefix: str) -> Tool:
    async def run(arguments: dict[str, Any]) -> str:
        result = await session.call_tool(listed.name, arguments)
        text = "\n".join(block.text for block in result.content if getattr(block, "type", None) == "text")
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content, ensure_ascii=False)
        if result.is_error:
            raise MCPToolError(text or "the server reported an error")
        return text

    return schema_tool(prefix + listed.name, listed.description or "", listed.input_schema, run)
