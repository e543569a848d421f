"""The tool loop against a real `tokenway serve` (the default model, greedy) and a real MCP
server (tests/client/mcp_server.py, over stdio and streamable HTTP): a round cap stops the loop
and says so; an invalid argument goes back to the model as an error result; MCP tools are
called through the loop."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Annotated

import openai
import pydantic
import pytest

from tokenway.client.mcp_tools import mcp_tools
from tokenway.client.resilient import ResilientChat
from tokenway.client.tool_loop import Limits, run_tool_loop
from tokenway.client.tools import tool

from .conftest import REPO, free_port

pytestmark = pytest.mark.anyio

MODEL = "smollm2-135m-instruct"
MCP_SERVER = REPO / "tests" / "client" / "mcp_server.py"


@pytest.fixture
async def chat(server):
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    yield ResilientChat([client])
    await client.close()


def ask(text: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 64, "temperature": 0,
            **fields}


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny, 21 C in {city}"


async def test_the_round_cap_stops_the_loop_and_says_why(chat, server):
    result = await run_tool_loop(chat, ask("What is the weather in Paris?", tool_choice="required"), [get_weather],
                                 Limits(max_rounds=2), reset_tool_choice=False)
    assert result.stop_reason == "max_rounds" and result.rounds == 2
    assert [run.outcome.error for run in result.runs][-1] == "not_run"
    assert result.runs[0].outcome.text.startswith("Sunny, 21 C in")
    # Every call has its result: the conversation goes on as it is.
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    again = client.chat.completions.create(model=MODEL, messages=list(result.messages), max_tokens=8)
    assert again.choices[0].message is not None


async def test_an_invalid_argument_reaches_the_model_as_an_error_result(chat):
    looked_up = []

    def order_number(value: str) -> str:
        if not value.startswith("ORD-"):
            raise ValueError('an order number looks like "ORD-" and five digits, e.g. ORD-00042')
        return value

    @tool
    def order_status(order: Annotated[str, pydantic.AfterValidator(order_number)]) -> str:
        """The delivery status of an order."""
        looked_up.append(order)
        return f"{order}: out for delivery"

    result = await run_tool_loop(chat, ask("Where is my order 12345?", tool_choice="required"), [order_status],
                                 Limits(max_rounds=3))
    first = result.runs[0]
    assert first.outcome.error == "invalid_arguments" and "ORD-" in first.outcome.text
    assert json.loads(first.arguments)["order"] not in looked_up  # the tool never saw the bad value
    sent = [m for m in result.messages if m["role"] == "tool"][0]
    assert sent["content"].startswith("Error: invalid arguments for order_status")
    assert result.rounds >= 2  # and the model was asked again with it


async def test_an_mcp_servers_tools_are_called_through_the_loop(chat, tmp_path):
    # The integer tool: its grammar keeps the call short and its result is exact. (A free
    # string argument let the 135M model write inside the string until max_tokens on one CPU.)
    log = tmp_path / "calls.jsonl"
    async with mcp_tools(command=sys.executable, args=[str(MCP_SERVER)], env={"MCP_CALL_LOG": str(log)}) as tools:
        assert {t.name for t in tools} == {"stock_level", "add"}
        result = await run_tool_loop(
            chat, ask("What is 17 plus 25?", tool_choice={"type": "function", "function": {"name": "add"}}),
            tools, Limits(max_rounds=3))
    assert log.exists(), [run.outcome for run in result.runs]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["name"] == "add"
    run = result.runs[0]
    assert run.name == "add" and run.outcome.error is None
    # The MCP server's own answer went back to the model as the call's result.
    arguments = json.loads(run.arguments)
    sent = [m for m in result.messages if m["role"] == "tool"]
    assert sent[0]["content"] == str(arguments["a"] + arguments["b"]) == run.outcome.text
    assert result.rounds == 2 and result.stop_reason in ("answered", "length")


@pytest.fixture
def mcp_http(tmp_path):
    port = free_port()
    with open(tmp_path / "mcp.log", "w") as log:  # the child holds its own copy of the file
        process = subprocess.Popen([sys.executable, str(MCP_SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                                   stderr=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


async def test_mcp_over_streamable_http(mcp_http):
    async with mcp_tools(url=mcp_http, prefix="shop_") as tools:
        by_name = {t.name: t for t in tools}
        assert set(by_name) == {"shop_stock_level", "shop_add"}
        assert (await by_name["shop_add"].invoke('{"a": 2, "b": 40}')).text == "42"
        assert (await by_name["shop_add"].invoke('{"a": 2}')).error == "invalid_arguments"
        unknown = await by_name["shop_stock_level"].invoke('{"item": "sprocket"}')
        assert unknown.error == "raised" and "unknown item 'sprocket'" in unknown.text
