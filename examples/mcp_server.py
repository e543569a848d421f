"""A small MCP server for the tool-loop example: a unit converter and a clock, over stdio.

    python examples/mcp_server.py            (the example starts it itself)
"""

from __future__ import annotations

import datetime

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("tokenway-example-tools")
TO_METRES = {"m": 1.0, "km": 1000.0, "mile": 1609.344, "ft": 0.3048, "in": 0.0254}


@server.tool()
def convert_length(value: float, from_unit: str, to_unit: str) -> str:
    """Converts a length between units: m, km, mile, ft, in."""
    for unit in (from_unit, to_unit):
        if unit not in TO_METRES:
            raise ToolError(f"unknown unit {unit!r}; use one of {', '.join(TO_METRES)}")
    result = value * TO_METRES[from_unit] / TO_METRES[to_unit]
    return f"{value} {from_unit} = {result:.4g} {to_unit}"


@server.tool()
def utc_now() -> str:
    """The current date and time in UTC."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


if __name__ == "__main__":
    server.run()
