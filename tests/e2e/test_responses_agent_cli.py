"""An agent CLI that speaks OpenAI's Responses API (OpenAI's Codex CLI, from npm) configured
for tokenway serve as a custom provider, completing one non-interactive turn: the case of the
issue, where such a CLI got `404 No route POST /v1/responses` and gave up after five retries.
It is installed from npm into this session's cache (never globally); without npm, or without
the registry, the test skips and says why."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Server

MODEL = "smollm2-135m-instruct"
CODEX_VERSION = "0.169.0"  # pinned: a new release must not change what this test checks unseen
MAX_TOKENS = 256
ATTEMPTS = 3


@pytest.fixture(scope="module")
def codex() -> Path:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent CLI (@openai/codex) comes from npm")
    prefix = Path(os.environ["TOKENWAY_CACHE_DIR"]) / f"codex-{CODEX_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        installed = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                                    f"@openai/codex@{CODEX_VERSION}"], capture_output=True, text=True, timeout=600)
        if installed.returncode != 0 or not binary.exists():
            pytest.skip(f"npm could not install @openai/codex@{CODEX_VERSION}: {installed.stderr[-500:]}")
    return binary


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
    # user's own config (and any OpenAI login) out of it. Codex asks for OpenAI's hosted web
    # search unless told not to, and tokenway refuses built-in tools (a 400 naming it). Its own
    # instructions and some tool groups are left out so that the prompt fits the test model's
    # 8,192-token window, and prefills in seconds rather than minutes on a CPU.
    instructions = home / "instructions.md"
    instructions.write_text("You are a terse assistant. Answer in one sentence.\n")
    (home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "tokenway"
model_instructions_file = "{instructions}"
web_search = "disabled"

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
