"""Work a killed server had done is billed: `tokenway serve` SIGKILLed, with its children, while
two background responses run on it, then started again on the same data directory. Their
leases (1 s here) pass with no server holding them, and the new server fails each and writes
its one ledger row: the prompt and the tokens generated as the killed server last kept them
with its lease, at the model's price, under the response's id. /v1/usage says the same, and the
key's budget, seeded from the ledger by the new server, counts that spend."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import Server
from .test_gateway_policy import create_key
from .test_killed_billing import wait_for

MODEL = "smollm2-135m-instruct"
# A token costs $0.001, prompt, cached or completion: a response costs (prompt + completion) * $0.001.
CONFIG = (f'responses_lease_seconds = 1.0\n[prices."{MODEL}"]\ninput = 1000.0\ncached_input = 1000.0\n'
          "output = 1000.0\n")
BUDGET_USD = 3.0  # both responses' worst cases (prompt + max_output_tokens each) fit at once
COUNT = "Count from 1 to 1000, one number a line."  # greedy, it runs past 300 tokens
MAX_OUTPUT_TOKENS = 600
NUM_KEPT_BEFORE_KILL = 16  # completion tokens each response's lease renewals have kept


def kept_usage(db: Path, response_ids: list[str]) -> dict[str, tuple[int, int]]:
    """(prompt_tokens, completion_tokens) as each response's last lease renewal kept them."""
    with sqlite3.connect(db) as conn:
        return {rid: (p, c) for rid, p, c in conn.execute(
            f"SELECT id, prompt_tokens, completion_tokens FROM stored_responses WHERE id IN "
            f"({', '.join('?' for _ in response_ids)})", response_ids)}


def kill_with_children(pid: int) -> None:
    """SIGKILL to the server and every process under it at once, as to its process group (the
    test's Server shares pytest's group): nothing of it runs a shutdown."""
    pids, frontier = [pid], [pid]
    while frontier:
        found = subprocess.run(["pgrep", "-P", ",".join(map(str, frontier))], capture_output=True, text=True)
        frontier = [int(child) for child in found.stdout.split()]
        pids += frontier
    for each in pids:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture()
def killed(tmp_path, default_model_dir):
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    db = Path(os.environ["TOKENWAY_DATA_DIR"]) / f"killed-server-{os.getpid()}.db"
    args = ("--config", str(config), "--no-embeddings")
    server = Server(*args, db=db)
    key = create_key(server.db, "--name", "killed-server", "--budget-usd", str(BUDGET_USD))
    # The first key turns auth on within ~2 s: until then a call is anonymous, with no budget.
    wait_for(lambda: httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401)
    servers = [server]
    yield servers, args, db, key
    for each in servers:
        each.stop()


def test_background_responses_of_a_killed_server_are_billed_what_they_generated(killed):
    servers, args, db, key = killed
    first = servers[0]
    client = openai.OpenAI(base_url=f"{first.base_url}/v1", api_key=key, max_retries=0)
    response_ids = [client.responses.create(model=MODEL, input=COUNT, background=True, temperature=0,
                                            max_output_tokens=MAX_OUTPUT_TOKENS).id for _ in range(2)]
    wait_for(lambda: all(completion >= NUM_KEPT_BEFORE_KILL
                         for _, completion in kept_usage(db, response_ids).values()))
    kill_with_children(first.process.pid)
    first.process.wait()
    kept = kept_usage(db, response_ids)  # final: nothing renews them now

    restarted = Server(*args, db=db)
    servers.append(restarted)
    client = openai.OpenAI(base_url=f"{restarted.base_url}/v1", api_key=key, max_retries=0)
    stored = {rid: wait_for(lambda rid=rid: (response := client.responses.retrieve(rid)).status
                            not in ("queued", "in_progress") and response) for rid in response_ids}
    spent_usd = 0.0
    for rid in response_ids:
        assert stored[rid].status == "failed" and "stopped before it finished" in stored[rid].error.message
        prompt_tokens, completion_tokens = kept[rid]
        assert prompt_tokens > 0 and completion_tokens >= NUM_KEPT_BEFORE_KILL
        row = restarted.ledger_row(rid)
        assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (500, prompt_tokens,
                                                                                   completion_tokens), row
        assert row["cost_usd"] == pytest.approx((prompt_tokens + completion_tokens) / 1000)
        spent_usd += row["cost_usd"]
    with sqlite3.connect(db) as conn:  # one row each, ever (the POSTs that made them write none)
        assert conn.execute("SELECT COUNT(*) FROM usage_ledger").fetchone()[0] == len(response_ids)

    headers = {"Authorization": f"Bearer {key}"}
    [usage] = httpx.get(f"{restarted.base_url}/v1/usage", headers=headers, timeout=10).json()["data"]
    assert (usage["requests"], usage["refused_requests"]) == (len(response_ids), 0), usage
    assert usage["prompt_tokens"] == sum(p for p, _ in kept.values())
    assert usage["completion_tokens"] == sum(c for _, c in kept.values())
    assert usage["cost_usd"] == pytest.approx(spent_usd)

    # The budget left is the budget less that spend: a call too large for it is told what remains.
    refused = httpx.post(f"{restarted.base_url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": COUNT}], "max_tokens": 5000})
    assert refused.status_code == 429, refused.text
    remains = re.search(r"more than the \$([0-9.,]+) that remains", refused.json()["error"]["message"])
    assert remains is not None, refused.text
    assert float(remains.group(1).replace(",", "")) == pytest.approx(BUDGET_USD - spent_usd)
