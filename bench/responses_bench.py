"""What /v1/responses costs over /v1/chat/completions, and what continuing a long stored
conversation by previous_response_id costs to template and tokenize.

    python bench/responses_bench.py                 # 2000 rounds, a 50-turn conversation (~3 min)
    python bench/responses_bench.py --rounds 300    # quicker

One fresh `tokenway serve` (gateway on: auth, limits and the SQLite ledger, as served).

1. Per-call overhead. Each round sends the same prompt (one user message, max 1 token,
   temperature 0) as a chat completion, a response with store false and a response with store
   true (stored in the ledger's database), one after the other on one keep-alive connection,
   in an order that rotates each round, so the three meet the same machine at the same moments.
   Printed: each API's client latency p50/p90, and the p50 of the per-round differences
   (responses - chat), both from the client and from the server's own Server-Timing total.
2. A stored conversation of --turns turns, each continued by previous_response_id. For turns 1,
   10, 25 and the last: the prompt's tokens, the server's `routing` stage (it holds the chain's
   one query) and `tokenize` stage (the conversation as messages, the chat template, the
   tokenizer), and the last turn's conversation sent as chat messages to /v1/chat/completions
   (its `tokenize` stage: the chat path's own cost). Then, in this process on the model's
   tokenizer, the last turn's prompt: the chat template's render, tokenizing it whole (no
   cache), and tokenizing it with the segment cache warm from the turn before
   (frontend/segment_cache.py), which is what the server does.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
PROMPT = "Say hi."
# The stages where the APIs' own work shows (parsing; templating; rendering, and storing a stored
# response; the ledger row, before the last byte).
STAGES = ("validation", "tokenize", "postprocess", "billing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenway.cli", "serve", "--port", str(port), "--db", str(data_dir / "tokenway.db"),
         "--log-level", "warning"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tokenway serve exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("tokenway serve did not become ready")


def server_timing(response: httpx.Response) -> dict[str, float]:
    stage_to_ms = {}
    for part in response.headers.get("server-timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            stage_to_ms[name] = float(dur)
    return stage_to_ms


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


REQUESTS = {  # name -> (path, body)
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                      "max_tokens": 1, "temperature": 0}),
    "responses store=false": ("/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 1,
                                                "temperature": 0, "store": False}),
    "responses store=true": ("/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 1,
                                               "temperature": 0}),
}


def overhead(client: httpx.Client, rounds: int) -> None:
    names = list(REQUESTS)
    client_ms: dict[str, list[float]] = {name: [] for name in names}
    server_ms: dict[str, list[float]] = {name: [] for name in names}
    stage_ms: dict[str, dict[str, list[float]]] = {name: {stage: [] for stage in STAGES} for name in names}
    for round_index in range(rounds + 50):
        order = names[round_index % 3:] + names[:round_index % 3]
        for name in order:
            path, body = REQUESTS[name]
            start = time.perf_counter()
            response = client.post(path, json=body)
            elapsed_ms = (time.perf_counter() - start) * 1000
            assert response.status_code == 200, response.text
            if round_index >= 50:  # the first rounds warm caches and connections
                client_ms[name].append(elapsed_ms)
                # The server's time without billing, which the middleware awaits after the body is built.
                timing = server_timing(response)
                server_ms[name].append(timing["total"] - timing.get("billing", 0.0))
                for stage in STAGES:
                    stage_ms[name][stage].append(timing.get(stage, 0.0))
    print(f"\n1. per call, same prompt, {rounds} alternated rounds (ms)")
    print(f"{'':24} {'client p50':>11} {'p90':>8} {'server p50':>11}   {'- chat: client p50':>19} {'server p50':>11}")
    for name in names:
        client_diff = [a - b for a, b in zip(client_ms[name], client_ms["chat"])]
        server_diff = [a - b for a, b in zip(server_ms[name], server_ms["chat"])]
        print(f"{name:24} {statistics.median(client_ms[name]):11.3f} {percentile(client_ms[name], 90):8.3f} "
              f"{statistics.median(server_ms[name]):11.3f}   {statistics.median(client_diff):19.3f} "
              f"{statistics.median(server_diff):11.3f}")
    print(f"\n   stages, server p50 (ms):  {'  '.join(f'{stage:>11}' for stage in STAGES)}")
    for name in names:
        print(f"   {name:24}" + "".join(f"{statistics.median(stage_ms[name][stage]):13.3f}" for stage in STAGES))


SAMPLES = 7  # calls a figure of part 2 is the median of


def conversation(client: httpx.Client, num_turns: int) -> list[dict]:
    print(f"\n2. a stored conversation of {num_turns} turns, each continued by previous_response_id "
          f"(medians of {SAMPLES} continuations, not stored)")
    print(f"{'turn':>5} {'input tokens':>13} {'routing ms':>11} {'tokenize ms':>12}")
    messages: list[dict] = []
    previous_id = None
    for turn in range(1, num_turns + 1):
        text = f"Turn {turn}: tell me one short fact about the number {turn}, in a sentence or two."
        body = {"model": MODEL, "input": text, "max_output_tokens": 24, "temperature": 0,
                "previous_response_id": previous_id}
        if turn in (1, 10, 25, num_turns):
            samples = [client.post("/v1/responses", json={**body, "max_output_tokens": 1, "store": False})
                       for _ in range(SAMPLES)]
            routing = statistics.median(server_timing(r).get("routing", 0.0) for r in samples)
            tokenize = statistics.median(server_timing(r).get("tokenize", 0.0) for r in samples)
            print(f"{turn:5} {samples[0].json()['usage']['input_tokens']:13} {routing:11.2f} {tokenize:12.2f}")
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        created = response.json()
        previous_id = created["id"]
        reply = "".join(part["text"] for item in created["output"] if item["type"] == "message"
                        for part in item["content"])
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    prompt = messages[:-1]  # the last turn's prompt: every turn before, and its own input
    chat = [client.post("/v1/chat/completions", json={"model": MODEL, "messages": prompt, "max_tokens": 1,
                                                      "temperature": 0}) for _ in range(SAMPLES)]
    tokenize = statistics.median(server_timing(r).get("tokenize", 0.0) for r in chat)
    print(f"   the same {num_turns} turns as messages to /v1/chat/completions: tokenize {tokenize:.2f} ms")
    return prompt


def tokenize_in_process(messages: list[dict]) -> None:
    from tokenway.config import DEFAULT_MODEL
    from tokenway.frontend.model import ModelFrontend
    from tokenway.models.loader import resolve_model

    tokenizer = ModelFrontend.from_dir(resolve_model(DEFAULT_MODEL)).tokenizer
    previous = tokenizer.apply_chat_template(messages[:-2], add_generation_prompt=True)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def timed(work) -> float:
        start = time.perf_counter()
        work()
        return (time.perf_counter() - start) * 1000

    template_ms = statistics.median(timed(lambda: tokenizer.apply_chat_template(messages)) for _ in range(SAMPLES))
    whole = tokenizer.hf.encode(text, add_special_tokens=False).ids
    whole_ms = statistics.median(timed(lambda: tokenizer.hf.encode(text, add_special_tokens=False))
                                 for _ in range(SAMPLES))
    cached_ms = []
    for _ in range(SAMPLES):
        if not tokenizer.enable_segment_cache():  # a fresh cache each time, warm from the turn before only
            break
        tokenizer.encode(previous, add_special_tokens=False)
        cached_ms.append(timed(lambda: tokenizer.encode(text, add_special_tokens=False)))
    assert tokenizer.encode(text, add_special_tokens=False) == whole
    print(f"\n   the last turn's prompt ({len(whole)} tokens), in process (medians of {SAMPLES}): chat template "
          f"{template_ms:.2f} ms, tokenized whole {whole_ms:.2f} ms, with the segment cache warm from the turn "
          f"before {statistics.median(cached_ms) if cached_ms else float('nan'):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        process, base_url = start_server(Path(data_dir))
        try:
            with httpx.Client(base_url=base_url, timeout=60) as client:
                overhead(client, args.rounds)
                messages = conversation(client, args.turns)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    tokenize_in_process(messages)


if __name__ == "__main__":
    main()
