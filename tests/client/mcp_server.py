"""A small MCP server for the tool-loop tests (the official SDK's MCPServer): stdio by default,
streamable HTTP with `--http PORT`. Its calls are appended to the file in $MCP_CALL_LOG."""

from __future__ import annotations

import json
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("tokenway-test-tools")
STOCK = {"widget": 12, "gadget": 0, "gizmo": 7}


def log(name: str, arguments: dict) -> None:
    if path := os.environ.get("MCP_CALL_LOG"):
        with open(path, "a") as out:
            out.write(json.dumps({"name": name, "arguments": arguments}) + "\n")


@server.tool()
def stock_level(item: str) -> str:
    """How many of an item are in stock."""
    log("stock_level", {"item": item})
    if item not in STOCK:
        raise ToolError(f"unknown item {item!r}; known: {', '.join(STOCK)}")
    return f"{STOCK[item]} {item}s in stock"


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    log("add", {"a": a, "b": b})
    return a + b


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
