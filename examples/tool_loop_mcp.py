"""The tool loop with an MCP server's tools, against `tokenway serve`.

    tokenway serve &                                   # the default model on :8000
    python examples/tool_loop_mcp.py [--url http://127.0.0.1:8000] [question]

Starts examples/mcp_server.py over stdio, gives its tools to the model, runs the calls the
model makes (validated against each tool's schema first), and prints every call, the answer
and why the loop stopped. The first round must call a tool (tool_choice "required"); after it
the model may answer (the loop resets tool_choice to "auto"). The default model has 135M
parameters: it calls the tools well under a grammar, and answers with less sense.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import openai

from tokenway.client.mcp_tools import mcp_tools
from tokenway.client.resilient import ResilientChat
from tokenway.client.tool_loop import Limits, run_tool_loop

HERE = Path(__file__).resolve().parent


async def main(url: str, question: str, model: str | None) -> int:
    client = openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="unused")
    model = model or (await client.models.list()).data[0].id
    async with mcp_tools(command=sys.executable, args=[str(HERE / "mcp_server.py")]) as tools:
        print("tools:", ", ".join(t.name for t in tools))
        request = {"model": model, "messages": [{"role": "user", "content": question}],
                   "tool_choice": "required", "max_tokens": 128, "temperature": 0}
        result = await run_tool_loop(ResilientChat([client]), request, tools, Limits(max_rounds=4, max_seconds=120))
    for run in result.runs:
        status = f" [{run.outcome.error}]" if run.outcome.error else ""
        print(f"round {run.round}: {run.name}({run.arguments}) -> {run.outcome.text}{status}")
    print(f"answer: {result.reply}")
    print(f"stopped: {result.stop_reason} after {result.rounds} rounds, {result.usage.total_tokens} tokens, "
          f"{result.seconds:.2f} s")
    await client.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="Convert 3 km to ft.")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.url, args.question, args.model)))
