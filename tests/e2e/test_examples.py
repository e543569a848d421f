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


def test_rag_over_the_readme_prints_its_sources_and_an_answer(server, tmp_path):
    # The README's first sections (the full file embeds for ~15 s on two cores): same code path.
    readme = (REPO / "README.md").read_text()
    excerpt = tmp_path / "README.md"
    excerpt.write_text(readme[:readme.index("\n## Observability")])
    args = ["How do I create an API key?", "--url", server.base_url, "--file", str(excerpt),
            "--db", str(tmp_path / "rag.db"), "--k", "2", "--max-tokens", "16"]
    out = example("rag_readme.py", *args)
    assert re.search(r"^index: .*README\.md -> \d+ chunks, \d+ tokens embedded$", out, re.MULTILINE)
    sources = re.findall(r"^  \[(\d)\] README\.md § (.+) \(chars \d+-\d+\)  score [\d.-]+$", out, re.MULTILINE)
    assert [number for number, _ in sources] == ["1", "2"]
    assert "Keys, limits, budgets and the usage ledger" in [section for _, section in sources]
    assert re.search(r"^context: 2 passages kept, 0 dropped, \d+ prompt tokens of \d+$", out, re.MULTILINE)
    answer = re.search(r"^answer:\n(.*)\n\[\d+ prompt tokens, \d+ completion tokens\]\n\Z", out,
                       re.MULTILINE | re.DOTALL)
    assert answer and answer.group(1).strip()
