"""Work a killed engine had done is billed: the engine process SIGKILLed while a streamed call,
a non-streamed one and a background response run on it. Each ends in an error, and each one's
ledger row (and trace) carries its prompt and the tokens it had generated, at their price; the
key's budget is settled with the same spend, not released as if nothing had run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from .conftest import Server
from .test_gateway_policy import create_key

MODEL = "smollm2-135m-instruct"
# A token costs $0.001 (1,000,000 nanos), prompt, cached or completion: a call costs
# exactly (prompt + completion tokens) * $0.001.
PRICES = f'[prices."{MODEL}"]\ninput = 1000.0\ncached_input = 1000.0\noutput = 1000.0\n'
BUDGET_TOKENS = 3000  # $3: the three calls' worst cases (prompt + max_tokens each) fit at once
COUNT = "Count from 1 to 1000, one number a line."  # greedy, it runs past 300 tokens
MAX_TOKENS = 600
NUM_STREAMED_BEFORE_KILL = 8


def wait_for(predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def priced(default_model_dir, tmp_path_factory):
    prices = tmp_path_factory.mktemp("killed") / "prices.toml"
    prices.write_text(PRICES)
    server = Server("--config", str(prices), "--no-embeddings")
    key = create_key(server.db, "--name", "killed", "--budget-usd", str(BUDGET_TOKENS / 1000))
    # The first key turns auth on within ~2 s: until then a call is anonymous, with no budget.
    wait_for(lambda: httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401)
    yield server, {"Authorization": f"Bearer {key}"}
    assert server.stop() == 0, server.read_log()[-3000:]


def test_calls_running_when_the_engine_is_killed_are_billed_what_they_generated(priced):
    server, headers = priced
    engine_pid = httpx.get(f"{server.base_url}/engine/stats", headers=headers, timeout=10).json()["engine_pid"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": COUNT}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    background = httpx.post(f"{server.base_url}/v1/responses", headers=headers, timeout=30, json={
        "model": MODEL, "input": COUNT, "background": True, "max_output_tokens": MAX_TOKENS, "temperature": 0})
    assert background.status_code == 200, background.text
    response_id = background.json()["id"]
    answered: dict[str, httpx.Response] = {}
    plain = threading.Thread(target=lambda: answered.setdefault("plain", httpx.post(
        f"{server.base_url}/v1/chat/completions", headers=headers, timeout=300, json=chat)))
    plain.start()

    num_streamed, events = 0, []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers=headers, timeout=300,
                      json={**chat, "stream": True, "logprobs": True}) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(event := json.loads(line[6:]))
            for choice in event.get("choices") or ():
                num_streamed += len((choice.get("logprobs") or {}).get("content") or ())
            if num_streamed >= NUM_STREAMED_BEFORE_KILL and engine_pid is not None:
                os.kill(engine_pid, signal.SIGKILL)
                engine_pid = None
    plain.join(300)
    assert "engine stopped" in events[-1]["error"]["message"], events[-1]

    # The stream: its row carries the prompt and exactly the tokens it had streamed, at their price.
    row = server.ledger_row(stream_id)
    assert row["status"] == 500 and row["prompt_tokens"] > 0, row
    assert row["completion_tokens"] == num_streamed, (row, num_streamed)
    assert round(row["cost_usd"] * 1000) == row["prompt_tokens"] + num_streamed
    trace = httpx.get(f"{server.base_url}/v1/traces/{stream_id}", headers=headers, timeout=10).json()
    assert (trace["status"], trace["prompt_tokens"], trace["completion_tokens"]) == (500, row["prompt_tokens"],
                                                                                   num_streamed)
    assert trace["cost_usd"] == row["cost_usd"]

    # Not streamed: a 500, and its row bills the tokens the engine had sent it.
    plain_response = answered["plain"]
    assert plain_response.status_code == 500, plain_response.text
    plain_row = server.ledger_row(plain_response.headers["x-request-id"])
    assert plain_row["status"] == 500 and plain_row["completion_tokens"] > 0, plain_row
    assert round(plain_row["cost_usd"] * 1000) == plain_row["prompt_tokens"] + plain_row["completion_tokens"]

    # The background response: stored failed, its usage what its row bills.
    stored = wait_for(lambda: (body := httpx.get(f"{server.base_url}/v1/responses/{response_id}", headers=headers,
                                                 timeout=10).json())["status"] not in ("queued", "in_progress")
                      and body)
    assert stored["status"] == "failed" and "engine stopped" in stored["error"]["message"], stored
    background_row = server.ledger_row(response_id)
    assert background_row["status"] == 500, background_row
    assert background_row["completion_tokens"] == stored["usage"]["output_tokens"] > 0
    assert background_row["prompt_tokens"] == stored["usage"]["input_tokens"] > 0

    # The budget was settled with that spend: what it says remains is the budget less the three rows.
    spent_tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in (row, plain_row, background_row))
    wait_for(lambda: httpx.get(f"{server.base_url}/ready", timeout=10).status_code == 200)  # the engine is back
    fit = BUDGET_TOKENS - spent_tokens - row["prompt_tokens"]

    def refusal() -> str:
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=60,
                             json={**chat, "max_tokens": 5000})
        assert refused.status_code == 429, refused.text
        return refused.json()["error"]["message"]

    wait_for(lambda: refusal().endswith(f"lower max_tokens to {fit} or less."), timeout=10)
