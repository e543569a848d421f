"""`tokenway chat` against a real server, driven through its stdin as a user types."""

from __future__ import annotations

import re
import subprocess
import sys

from .conftest import REPO, free_port

MCP_SERVER = REPO / "tests" / "client" / "mcp_server.py"


def chat(*args: str, typed: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenway.cli", "chat", *args], input=typed, text=True,
                          capture_output=True, timeout=180, cwd=REPO)


def test_a_conversation_streams_and_reports_each_turn(server):
    done = chat("--url", server.base_url, "--max-tokens", "24", "--temperature", "0",
                typed="Name two colours.\n/budget\nAnd one more?\n/reset\n/budget\n/nope\n/quit\n")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("tokenway chat · smollm2-135m-instruct at ")
    turns = re.findall(r"\[(\d+) in \((\d+) cached\) · (\d+) out · \$[\d.]+ · first token [\d.]+ s · [\d.]+ s", out)
    assert len(turns) == 2
    assert int(turns[1][0]) > int(turns[0][0]) and int(turns[1][1]) > 0  # the second turn reuses the first's prefix
    budgets = re.findall(r"prompt (\d+) tokens · 24 reserved for the reply · window 8192 · \d+ left · (\d+) messages",
                         out)
    assert [int(n) for _, n in budgets] == [2, 0]
    assert "conversation cleared" in out and "unknown command /nope" in out


def test_tools_from_an_mcp_server_are_listed(server):
    done = chat("--url", server.base_url, "--mcp", f"{sys.executable} {MCP_SERVER}", typed="/tools\n")
    assert done.returncode == 0, done.stderr
    assert "2 tools" in done.stdout
    assert "stock_level(item): How many of an item are in stock." in done.stdout
    assert "add(a, b): Adds two integers." in done.stdout


def test_an_unreachable_server_is_one_clear_line():
    done = chat("--url", f"http://127.0.0.1:{free_port()}", typed="hi\n")
    assert done.returncode == 1
    assert "tokenway chat: cannot reach" in done.stdout and "Traceback" not in done.stdout + done.stderr
