"""An agent CLI that speaks Anthropic's Messages API (Anthropic's Claude Code, from npm) pointed
at tokenway serve by ANTHROPIC_BASE_URL, completing one non-interactive turn (`-p`) as it
comes: `--bare` keeps its prompt to three tools, about 1,000 tokens, where its default tools
make about 12,300, over the test model's 8,192-token window. It asks adaptive thinking, context
edits and an effort of any model, with its tools' cache_control. The CLI is installed
from npm into this session's cache (never globally); without npm, or without the registry,
the test skips and says why."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import Server
from .npm_cli import npm_cli
from .test_responses_agent_cli import num_rows, rows_after

MODEL = "smollm2-135m-instruct"
CLAUDE_CODE_VERSION = "2.1.332"  # pinned: a new release must not change what this test checks unseen
MAX_OUTPUT_TOKENS = 512
MAX_TURNS = 3
ATTEMPTS = 4
ATTEMPT_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def claude():
    return npm_cli("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = Server()
    yield server
    assert server.stop() == 0


def sampled_miss(result: dict) -> bool:
    """The ways a turn may fail here, the test model's doing and not tokenway's: its sampled
    reply (Claude Code sends no temperature, so 1.0) ran past MAX_OUTPUT_TOKENS, or it called
    its tools on past MAX_TURNS. A reply tokenway refused or broke is an api_error_status."""
    return result.get("api_error_status") is None and (
        result.get("subtype") == "error_max_turns" or "output token maximum" in str(result.get("result")))


def cli_env(server: Server, home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "unused", "NO_COLOR": "1",
            # Nothing but the turn itself: no update checks, telemetry or error reports.
            "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            # Its own setting for the max_tokens it asks (32,000 unset, which the server cuts to
            # the window): a reply that rambles on ends in seconds, not minutes on a CPU.
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS)}


def test_claude_code_completes_a_turn(claude, server, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = cli_env(server, home)
    before = num_rows(server.db)
    for _ in range(ATTEMPTS):
        try:
            run = subprocess.run(
                [str(claude), "--bare", "-p", "Reply with one short sentence: what is the capital of France?",
                 "--model", MODEL, "--max-turns", str(MAX_TURNS), "--output-format", "json"],
                cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=ATTEMPT_TIMEOUT_S,
                env=env)
        except subprocess.TimeoutExpired:
            # A sampled reply that keeps calling tools: each of its calls answered (the ledger
            # has them), the CLI's turn loop ran on. Every attempt timing out fails below.
            continue
        result = json.loads(run.stdout) if run.stdout.startswith("{") else {}
        if run.returncode == 0 and result.get("is_error") is False:
            break
        assert sampled_miss(result), (run.stdout[-3000:], run.stderr[-3000:])
    else:
        pytest.fail(f"no turn of {ATTEMPTS} completed")
    assert run.returncode == 0 and result.get("is_error") is False, (run.stdout[-3000:], run.stderr[-3000:])
    assert result["type"] == "result" and result["subtype"] == "success" and result["result"].strip(), result
    assert result["usage"]["output_tokens"] > 0
    assert rows_after(server.db, before) > before  # its calls reached the model, each billed


def test_its_default_tools_overflow_the_window_with_a_clear_message(claude, server, tmp_path):
    """Without --bare, its prompt is about 12,300 tokens: the 400 is shown as the server wrote it."""
    home = tmp_path / "home"
    home.mkdir()
    run = subprocess.run([str(claude), "-p", "hi", "--model", MODEL, "--max-turns", "1", "--output-format", "json"],
                         cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
                         env=cli_env(server, home))
    result = json.loads(run.stdout) if run.stdout.startswith("{") else {}
    assert result.get("is_error") and result.get("api_error_status") == 400, (run.stdout[-3000:], run.stderr[-3000:])
    assert "maximum context length is 8192 tokens" in result["result"], result["result"]
