"""What a Batch API backlog costs interactive traffic, and what the batch gets of the engine.

    python bench/batch_bench.py                        # ~15 min: 3 bounds x 2 rounds, then offline
    python bench/batch_bench.py --bounds 0.25 --rounds 1 --window 15 --lines 400   # quicker

For each --batch-slowdown bound (rounds alternate their order), one fresh `tokenway serve` on
the default model (gateway off):

1. 4 interactive streams (closed loop: each sends its next chat completion when the last ends;
   --max-tokens tokens each, ignore_eos, greedy) for --window seconds, no batch: TTFT p50/p99,
   TPOT p50 (vLLM's definition: (e2e - ttft) / (tokens - 1)).
2. A --lines line batch of chat completions (the same shape) submitted through /v1/files and
   /v1/batches; once its lines run, the same 4 streams for --window seconds: their TTFT and
   TPOT against step 1's, and the batch's tokens/s over the window (the engine's own count of
   tokens generated for class "batch", /engine/stats). The batch is then cancelled.

Then the batch alone: --offline-lines lines through the Batch API on a fresh server (default
bound), wall time from create to completed, against the engine's offline throughput on the
same prompts (tokenway.LLM.generate, the same sampling, run first with no server up).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
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
sys.path.insert(0, str(REPO))
MODEL = "smollm2-135m-instruct"
NUM_STREAMS = 4
TOPICS = ["the sea", "a city at night", "an old clock", "the first snow", "a lighthouse", "a train journey",
          "a market", "the desert", "a library", "a storm"]


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}, number {i}."}]


def chat_body(i: int, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": prompt(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body["stream"] = True
    return body


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenway.cli", "serve", "--port", str(port), "--db", str(data_dir / "tokenway.db"),
         "--no-embeddings", "--log-level", "warning", *flags], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tokenway serve exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("tokenway serve did not become ready")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


async def one_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[float, float] | None:
    """(TTFT, TPOT) in seconds of one streamed chat completion."""
    start = time.perf_counter()
    first = last = None
    num_chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=chat_body(i, max_tokens, stream=True)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"stream answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                num_chunks += 1
    if first is None or last is None or num_chunks < 2:
        return None
    # Tokens: max_tokens with ignore_eos (chunks may merge tokens; the count is the request's).
    return first - start, (last - first) / (max_tokens - 1)


async def interactive(base_url: str, window_s: float, max_tokens: int) -> tuple[list[float], list[float]]:
    ttfts: list[float] = []
    tpots: list[float] = []
    deadline = time.perf_counter() + window_s
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def stream_loop(stream_index: int) -> None:
            i = stream_index
            while time.perf_counter() < deadline:
                result = await one_stream(client, 10_000 + i, max_tokens)
                if result is not None:
                    ttfts.append(result[0])
                    tpots.append(result[1])
                i += NUM_STREAMS

        await asyncio.gather(*(stream_loop(s) for s in range(NUM_STREAMS)))
    return ttfts, tpots


def batch_tokens(base_url: str) -> int:
    stats = httpx.get(f"{base_url}/engine/stats", timeout=10).json()
    return stats["classes"]["batch"]["num_generated_tokens"]


def upload_lines(base_url: str, num_lines: int, max_tokens: int) -> str:
    """The batch's input file, uploaded: its id."""
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": chat_body(i, max_tokens)}) for i in range(num_lines)]
    upload = httpx.post(f"{base_url}/v1/files", data={"purpose": "batch"}, timeout=120,
                        files={"file": ("batch.jsonl", io.BytesIO("\n".join(lines).encode()), "application/jsonl")})
    upload.raise_for_status()
    return upload.json()["id"]


def create_batch(base_url: str, file_id: str) -> str:
    batch = httpx.post(f"{base_url}/v1/batches", timeout=60, json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    batch.raise_for_status()
    return batch.json()["id"]


def submit_batch(base_url: str, num_lines: int, max_tokens: int) -> str:
    return create_batch(base_url, upload_lines(base_url, num_lines, max_tokens))


def batch_status(base_url: str, batch_id: str) -> dict:
    return httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=30).json()


def summary(ttfts: list[float], tpots: list[float]) -> dict[str, float]:
    return {"n": len(ttfts), "ttft_p50": 1000 * percentile(ttfts, 50), "ttft_p99": 1000 * percentile(ttfts, 99),
            "tpot_p50": 1000 * statistics.median(tpots) if tpots else float("nan")}


def with_batch(bound: str, args: argparse.Namespace, data_dir: Path) -> dict:
    process, base_url = start_server(data_dir, "--batch-slowdown", bound)
    try:
        asyncio.run(interactive(base_url, 3, args.max_tokens))  # warm-up
        alone = summary(*asyncio.run(interactive(base_url, args.window, args.max_tokens)))
        batch_id = submit_batch(base_url, args.lines, args.max_tokens)
        deadline = time.monotonic() + 120
        while batch_tokens(base_url) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # the runner's lines under way
        before_tokens, before = batch_tokens(base_url), time.perf_counter()
        mixed = summary(*asyncio.run(interactive(base_url, args.window, args.max_tokens)))
        batch_tps = (batch_tokens(base_url) - before_tokens) / (time.perf_counter() - before)
        done = batch_status(base_url, batch_id)["request_counts"]
        httpx.post(f"{base_url}/v1/batches/{batch_id}/cancel", timeout=30)
        return {"bound": bound, "alone": alone, "mixed": mixed, "batch_tps": batch_tps, "batch_done": done}
    finally:
        stop_server(process)


def offline(args: argparse.Namespace) -> float:
    """The engine's offline tokens/s on the batch's prompts (LLM.generate, no server)."""
    from tokenway import LLM, SamplingParams
    from tokenway.config import DEFAULT_MODEL

    llm = LLM(DEFAULT_MODEL)
    conversations = [prompt(i) for i in range(args.offline_lines)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.chat(conversations[:16], params)  # warm-up
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    return sum(len(output.outputs[0].token_ids) for output in outputs) / elapsed


def batch_alone(args: argparse.Namespace, data_dir: Path) -> tuple[float, float]:
    """The Batch API's tokens/s with no other traffic: (create to completed, the engine's batch
    tokens over the same time)."""
    process, base_url = start_server(data_dir)
    try:
        file_id = upload_lines(base_url, args.offline_lines, args.max_tokens)
        start = time.perf_counter()  # create to completed: the upload is the client's, not the batch's
        batch_id = create_batch(base_url, file_id)
        while (status := batch_status(base_url, batch_id))["status"] not in ("completed", "failed", "expired",
                                                                             "cancelled"):
            time.sleep(0.25)
        elapsed = time.perf_counter() - start
        counts = status["request_counts"]
        if counts["completed"] != args.offline_lines:
            raise RuntimeError(f"the batch ended {status['status']} with {counts}")
        return args.offline_lines * args.max_tokens / elapsed, batch_tokens(base_url) / elapsed
    finally:
        stop_server(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bounds", default="0.1,0.25,0.5", help="--batch-slowdown values, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, default=30.0, help="seconds of interactive traffic measured")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--offline-lines", type=int, default=512)
    parser.add_argument("--skip-offline", action="store_true")
    args = parser.parse_args()
    bounds = args.bounds.split(",")

    with tempfile.TemporaryDirectory(prefix="tokenway-batch-bench-") as tmp:
        if not args.skip_offline:
            offline_tps = offline(args)
            api_tps, engine_tps = batch_alone(args, Path(tmp))
            print(f"\nbatch alone, {args.offline_lines} lines x {args.max_tokens} tokens: the Batch API "
                  f"{api_tps:.1f} tok/s (create to completed), LLM.generate {offline_tps:.1f} tok/s: "
                  f"{api_tps / offline_tps:.1%}")
        results = []
        for round_index in range(args.rounds):
            for bound in bounds if round_index % 2 == 0 else bounds[::-1]:
                data_dir = Path(tmp) / f"r{round_index}-{bound}"
                data_dir.mkdir()
                results.append(with_batch(bound, args, data_dir))
                result = results[-1]
                print(f"round {round_index + 1}, --batch-slowdown {bound}: {json.dumps(result)}", flush=True)

    if results:
        print_table(bounds, results, args)


def print_table(bounds: list[str], results: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{NUM_STREAMS} interactive streams beside a {args.lines}-line batch, {args.window:.0f} s windows "
          f"(medians of {args.rounds} rounds)")
    print(f"{'bound':>8} {'TTFT p50':>10} {'p99':>8} {'(alone p99)':>12} {'TPOT p50':>10} {'(alone)':>8} "
          f"{'TPOT +':>8} {'batch tok/s':>12}")
    for bound in bounds:
        rows = [r for r in results if r["bound"] == bound]

        def med(path: tuple[str, str], rows: list[dict] = rows) -> float:
            return statistics.median(r[path[0]][path[1]] for r in rows)

        tpot, tpot_alone = med(("mixed", "tpot_p50")), med(("alone", "tpot_p50"))
        print(f"{bound:>8} {med(('mixed', 'ttft_p50')):10.1f} {med(('mixed', 'ttft_p99')):8.1f} "
              f"{med(('alone', 'ttft_p99')):12.1f} {tpot:10.2f} {tpot_alone:8.2f} {tpot / tpot_alone - 1:8.1%} "
              f"{statistics.median(r['batch_tps'] for r in rows):12.1f}")


if __name__ == "__main__":
    main()
