"""What the streamed output check costs: TPOT with --safety-output redact against off, on two
servers of the default model, the same streamed workload alternated A B A B; and, from each
call's trace, the output check's own time over the call's decode time.

    python bench/safety_stream_bench.py                 # 3 rounds of 24 streams, c=4, 128 tokens

TPOT per stream is (last chunk - first visible content) / (completion tokens - 1), as serving
benchmarks compute it; content held back while a number forms moves the first visible token
later (TTFT, printed too) and sends some tokens together, neither of which is decode slower.

The goal: streamed output checks add no more than 5% to TPOT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
PROMPTS = ["Write a long story about a sailor who keeps a diary, with dates and the numbers of the ships.",
           "Explain how a bank transfer works, step by step, with example account numbers and amounts.",
           "List twenty cities and their phone country codes, then describe each city in a sentence.",
           "Describe your week in detail, day by day, with times of the day."]


def start(port: int, mode: str, data_dir: str) -> subprocess.Popen:
    env = {**os.environ, "TOKENWAY_DATA_DIR": data_dir}
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenway.cli", "serve", "--port", str(port), "--no-embeddings",
         "--safety-output", mode, "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the {mode} server did not start")


async def one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int
              ) -> tuple[float, float, int, str]:
    """(TTFT: the first visible content, end: the last chunk, both from the request; completion
    tokens; the request id)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.7, "seed": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = end = None
    tokens = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        request_id = response.headers.get("x-request-id", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
            if '"completion_tokens":' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            end = time.perf_counter() - started
    return first, end, tokens, request_id


async def run(base: str, num_streams: int, concurrency: int, max_tokens: int
              ) -> tuple[float, float, float | None]:
    """(TPOT p50 over streams in ms: (end - TTFT) / (tokens - 1), TTFT p50 in ms, check ms /
    decode ms over the calls' traces)."""
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def limited(i: int):
            async with semaphore:
                return await one(client, base, PROMPTS[i % len(PROMPTS)], max_tokens)
        results = await asyncio.gather(*(limited(i) for i in range(num_streams)))
        tpots = [(end - first) / (tokens - 1) * 1000 for first, end, tokens, _ in results if first and tokens > 1]
        ttfts = [first * 1000 for first, _, _, _ in results if first]
        check_ms = decode_ms = 0.0
        for *_, request_id in results:
            trace = (await client.get(f"{base}/v1/traces/{request_id}")).json()
            decode_ms += trace["stages_ms"]["decode"]
            check_ms += ((trace.get("safety") or {}).get("output") or {}).get("ms", 0.0)
    return statistics.median(tpots), statistics.median(ttfts), (check_ms / decode_ms if decode_ms else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        servers = {"off": start(18301, "off", data_dir), "redact": start(18302, "redact", data_dir)}
        try:
            tpot = {"off": [], "redact": []}
            ttft = {"off": [], "redact": []}
            shares = []
            for round_number in range(args.rounds):
                for mode, port in (("off", 18301), ("redact", 18302)):
                    p50, first, share = asyncio.run(run(f"http://127.0.0.1:{port}", args.streams,
                                                        args.concurrency, args.max_tokens))
                    tpot[mode].append(p50)
                    ttft[mode].append(first)
                    if mode == "redact" and share is not None:
                        shares.append(share)
                    print(f"round {round_number + 1} {mode:6s} TPOT p50 {p50:.2f} ms  TTFT p50 {first:.0f} ms"
                          + (f"  checks {share * 100:.2f}% of decode time" if mode == "redact" else ""), flush=True)
        finally:
            for process in servers.values():
                process.terminate()
                process.wait(30)
    off, redact = statistics.median(tpot["off"]), statistics.median(tpot["redact"])
    print(f"TPOT p50: off {off:.2f} ms, redact {redact:.2f} ms: {(redact / off - 1) * 100:+.1f}% "
          f"(goal: at most +5%); TTFT p50: off {statistics.median(ttft['off']):.0f} ms, redact "
          f"{statistics.median(ttft['redact']):.0f} ms; the checks themselves: "
          f"{statistics.median(shares) * 100:.2f}% of decode time")


if __name__ == "__main__":
    main()
