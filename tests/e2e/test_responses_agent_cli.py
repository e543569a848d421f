"""An agent CLI that speaks OpenAI's Responses API (OpenAI's Codex CLI, from npm) configured
for tokenway serve as a custom provider, completing one non-interactive turn. Codex lists its
hosted web_search tool with every request: the server leaves it out of the prompt (and names
it in the trace) rather than refusing the turn. The CLI is installed from npm into this
session's cache (never globally); without npm, or without the registry, the test skips and
says why."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Server
from .npm_cli import npm_cli

MODEL = "smollm2-135m-instruct"
CODEX_VERSION = "0.169.0"  # pinned: a new release must not change what this test checks unseen
MAX_TOKENS = 256
ATTEMPTS = 3


@pytest.fixture(scope="module")
def codex() -> Path:
    return npm_cli("@openai/codex", CODEX_VERSION, "codex")


@pytest.fixture(scope="module")
def capped(default_model_dir):
    """A server whose replies stop at MAX_TOKENS when the caller names no limit, as Codex names
    none: its replies are sampled (Codex sends no temperature, so 1.0), and the test model now
    and then writes on to the end of its window, minutes on a CPU."""
    server = Server("--default-max-tokens", str(MAX_TOKENS))
    yield server
    assert server.stop() == 0


def num_rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM usage_ledger WHERE status = 200").fetchone()[0]


def omitted_tools(db: Path) -> set[str]:
    """Every tool type the server left out of a call's prompt, as the calls' traces name them."""
    with sqlite3.connect(db) as conn:
        traces = [json.loads(trace or "{}") for (trace,) in conn.execute("SELECT trace FROM usage_ledger")]
    return {kind for trace in traces for kind in trace.get("omitted_tools") or ()}


def rows_after(db: Path, before: int, timeout: float = 10) -> int:
    """The rows once more than `before` are committed (or what there is at the deadline): a
    call's row is journaled before its reply ends, and committed with its window's rows, a
    moment after the client may have read the reply and exited."""
    deadline = time.monotonic() + timeout
    while (num := num_rows(db)) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return num


def test_an_agent_cli_on_the_responses_api_completes_a_turn(codex, capped, tmp_path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    # The custom provider, as a user writes it in ~/.codex/config.toml; CODEX_HOME keeps the
    # user's own config (and any OpenAI login) out of it. Its web search is left as it is: Codex
    # lists the hosted tool, and the server leaves it out. Its own instructions and some tool
    # groups are left out so that the prompt fits the test model's 8,192-token window (the whole
    # prompt is about 10,000 tokens), and prefills in seconds rather than minutes on a CPU.
    instructions = home / "instructions.md"
    instructions.write_text("You are a terse assistant. Answer in one sentence.\n")
    (home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "tokenway"
model_instructions_file = "{instructions}"
model_context_window = 8192

[model_providers.tokenway]
name = "tokenway"
base_url = "{capped.base_url}/v1"
wire_api = "responses"

[features]
goals = false
view_image = false

[agents]
enabled = false
""")
    before = num_rows(capped.db)
    for _ in range(ATTEMPTS):
        run = subprocess.run(
            [str(codex), "exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only",
             "Reply with one short sentence: what is the capital of France?"],
            cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
            env={**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "unused", "NO_COLOR": "1"})
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode == 0:
            break
        # The one way a turn may fail here: the sampled reply ran to MAX_TOKENS, which Codex (as
        # against OpenAI) reports as an incomplete response. Anything else is tokenway's doing.
        failures = [event for event in events if event.get("type") == "turn.failed"]
        assert failures and "max_output_tokens" in failures[-1]["error"]["message"], (
            run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    messages = [event["item"].get("text", "") for event in events
                if event.get("type") == "item.completed" and event.get("item", {}).get("type") == "agent_message"]
    assert messages and messages[-1].strip(), events[-5:]
    assert any(event.get("type") == "turn.completed" for event in events), events[-5:]
    assert rows_after(capped.db, before) > before  # its calls reached the model, each billed
    assert "web_search" in omitted_tools(capped.db)  # listed by Codex, left out of the prompt
