"""Prompt throughput of the engine alone: a cold prompt (prefix cache missed) and the same
prompt again with 8 new tokens (prefix cached), 1 token out, median of 4 prompts each.

    python bench/prefill_bench.py                    # 512 and 1,024 tokens
    python bench/prefill_bench.py --lengths 1000 2000 --dtype float32

Compare with llama.cpp's `llama-bench -p 512,1024` (ppN = prompt tokens per second), as
../shared/bench/peers.sh runs it first (KERNEL_BENCH=1).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway import LLM, SamplingParams  # noqa: E402
from tokenway.config import DEFAULT_MODEL  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=max(args.lengths) + 64)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    one = SamplingParams(temperature=0, max_tokens=1)

    def timed(tokens: list[int]) -> float:
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": tokens}], one)
        return time.perf_counter() - started

    timed(prompt(max(args.lengths)))  # warm-up: kernels, oneDNN primitives
    for n in args.lengths:
        cold, cached = [], []
        for _ in range(args.repeats):
            tokens = prompt(n)
            cold.append(timed(tokens))
            cached.append(timed(tokens + prompt(8)))
        c, h = statistics.median(cold), statistics.median(cached)
        print(f"prompt {n:5d}: cold {c * 1e3:7.0f} ms ({n / c:5.0f} tok/s)   "
              f"cached (+8 new tokens) {h * 1e3:6.1f} ms = {h / c * 100:4.1f}% of cold")


if __name__ == "__main__":
    main()
