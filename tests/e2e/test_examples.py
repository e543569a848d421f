"""The examples under examples/ run against `tokenway serve` as their docstrings say."""

from __future__ import annotations

import re
import subprocess
import sys

from .conftest import REPO


def example(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tool_loop_with_an_mcp_server(server):
    out = example("tool_loop_mcp.py", "--url", server.base_url)
    assert out.startswith("tools: convert_length, utc_now")
    assert re.search(r"round 1: convert_length\(\{.*\}\) -> [\d.]+ \w+ = [\d.e+-]+ \w+", out)
    assert re.search(r"stopped: answered after 2 rounds", out)


def test_resilient_streaming_goes_on_after_a_break(server):
    out = example("resilient_streaming.py", "--url", server.base_url, "--break-after", "10")
    assert "[broke off after 10 chunks: StreamClosed; going on]" in out
    assert re.search(r"\[length; served by .*; first token [\d.]+ s; 0 failed attempts", out)
