"""What tokenway.client costs the caller per call, before the request leaves: counting a
20-turn conversation's prompt tokens (LocalCounter: the server's own templating on the
model's files) and fitting it into a window (tokenway.client.context.fit).

    python bench/client_bench.py            # 200 timed runs each

The goal (issue 13): p50 under 1 ms for a 20-turn conversation with counting cached. This
prints where it stands without a cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway.client import LocalCounter  # noqa: E402  (after the sys.path line)
from tokenway.client.context import fit  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOPICS = ["ships", "rivers", "bread", "clocks", "bees", "glass", "trains", "maps", "salt", "wool"]


def conversation(turns: int = 20) -> list[dict]:
    messages = [{"role": "system", "content": "You are a patient historian."}]
    for turn in range(turns):
        topic = TOPICS[turn % len(TOPICS)]
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about {topic}. " + f"{topic} " * 30})
        messages.append({"role": "assistant", "content": f"About {topic}: " + "an answer " * 30})
    messages.append({"role": "user", "content": "Which topic was first?"})
    return messages


def timed(fn, runs: int) -> tuple[float, float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    counter = LocalCounter(MODEL)
    request = {"model": MODEL, "messages": conversation()}
    tokens = counter.count(request)
    p50, p99 = timed(lambda: counter.count(request), args.runs)
    print(f"count, 20 turns ({tokens} tokens): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    p50, p99 = timed(lambda: fit(request, counter, window=tokens + 64, max_tokens=64), args.runs)
    print(f"fit, already fitting (1 count): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    _, report = fit(request, counter, window=tokens // 2, max_tokens=64)
    p50, p99 = timed(lambda: fit(request, counter, window=tokens // 2, max_tokens=64), max(20, args.runs // 10))
    print(f"fit, half the window (drop_oldest, {len(report.dropped)} messages cut): p50 {p50:.2f} ms, "
          f"p99 {p99:.2f} ms (goal for the whole client overhead: p50 < 1 ms with counting cached)")


if __name__ == "__main__":
    main()
