"""Safety detectors benchmark: quality on the labelled set, and the latency of detect().

    python bench/safety_bench.py            # 1,000 timed runs per prompt
    python bench/safety_bench.py --quick    # 100

Quality: precision and recall per category over findings on tests/safety/data/pii_lines.tsv
(a finding counts as true when its line expects that category; counts per line), and the share
of lines whose found categories equal the expected ones exactly.
Latency: p50/p99 of detect() on a ~16,000-character (~4,000-token) prompt of mixed prose with
digits, dates, versions and a few PII items; and on the same length of prose with no digit and
no '@' (the fast path: only the key-prefix scans run). The goal (issue 12) is p99 under 1 ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenway.safety.detectors import CATEGORIES, detect  # noqa: E402  (after the sys.path line)

PII_LINES = REPO / "tests" / "safety" / "data" / "pii_lines.tsv"
PROMPT_CHARS = 16_000
WORDS = ("the model returns a list of tokens for each request and the scheduler decides which "
         "requests run in the next step while the cache keeps blocks of keys and values for "
         "prefixes that were seen before so that a long system prompt is computed only once").split()
NUMBERY = ("in 2024", "version 1.26.4", "$1,299.99", "on 2024-03-15", "at 14:30", "192.168.1.20",
           "order #4471-2290", "42%", "3.14159", "batch size 512", "uuid 550e8400-e29b-41d4-a716-446655440000")
PII = ("mail ann.lee@example.com", "call +44 20 7946 0958", "card 4111 1111 1111 1111",
       "IBAN GB82 WEST 1234 5698 7654 32", "key AKIAIOSFODNN7EXAMPLE")


def evaluate(path: Path) -> tuple[dict[str, Counter], int, int]:
    """Per category tp/fp/fn, the number of exactly matched lines, and the number of lines."""
    _, *rows = path.read_text(encoding="utf-8").splitlines()
    category_to_counts = {category: Counter() for category in CATEGORIES}
    num_exact = 0
    for row in rows:
        label, text = row.split("\t")
        expected = Counter() if label == "none" else Counter(label.split(","))
        found = Counter(f.category for f in detect(text))
        num_exact += found == expected
        for category in CATEGORIES:
            tp = min(found[category], expected[category])
            category_to_counts[category].update(tp=tp, fp=found[category] - tp, fn=expected[category] - tp)
    return category_to_counts, num_exact, len(rows)


def make_prompt(rng: random.Random, with_numbers: bool) -> str:
    pieces, num_chars = [], 0
    while num_chars < PROMPT_CHARS:
        piece = rng.choice(WORDS)
        if with_numbers and rng.random() < 0.03:
            piece = rng.choice(NUMBERY)
        pieces.append(piece)
        num_chars += len(piece) + 1
    if with_numbers:
        for item in PII:
            pieces.insert(rng.randrange(len(pieces)), item)
    return " ".join(pieces)[:PROMPT_CHARS]


def time_detect(text: str, num_runs: int) -> tuple[float, float]:
    for _ in range(50):
        detect(text)
    latencies = []
    for _ in range(num_runs):
        start = time.perf_counter()
        detect(text)
        latencies.append(time.perf_counter() - start)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    category_to_counts, num_exact, num_lines = evaluate(PII_LINES)
    print(f"labelled set: {num_lines} lines, {num_exact / num_lines:.1%} with the exact category set")
    print(f"{'category':<12} {'tp':>4} {'fp':>4} {'fn':>4} {'precision':>10} {'recall':>8}")
    for category, counts in [*category_to_counts.items(), ("overall", sum(category_to_counts.values(), Counter()))]:
        tp, fp, fn = counts["tp"], counts["fp"], counts["fn"]
        precision = tp / (tp + fp) if tp + fp else float("nan")
        recall = tp / (tp + fn) if tp + fn else float("nan")
        print(f"{category:<12} {tp:>4} {fp:>4} {fn:>4} {precision:>10.3f} {recall:>8.3f}")

    rng, num_runs = random.Random(0), 100 if args.quick else 1000
    for name, with_numbers in (("mixed prose + 5 PII items", True), ("no digit, no '@' (fast path)", False)):
        prompt = make_prompt(rng, with_numbers)
        p50, p99 = time_detect(prompt, num_runs)
        print(f"detect() on {len(prompt):,} chars, {name}: {len(detect(prompt))} findings, "
              f"p50 {p50:.3f} ms, p99 {p99:.3f} ms ({num_runs} runs)")


if __name__ == "__main__":
    main()
