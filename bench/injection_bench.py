"""How well tokenway.client's injection scan tells injected text from benign, on the labelled
sets in tests/fixtures/injection/, and what a scan costs. All three sets were written apart
from the scanner; dev.jsonl and test.jsonl were then developed on (the rules tuned, the probe
trained), holdout.jsonl never: its line is the figure to quote.

    python bench/injection_bench.py                 # each set: the rules, then rules + probe
    python bench/injection_bench.py --errors        # and every line the scan got wrong
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_injection_probe import embed  # noqa: E402

from tokenway.client.injection import scan  # noqa: E402  (after the sys.path line)

SETS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "injection"


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (SETS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def evaluate(rows: list[dict], vectors=None) -> dict:
    tp = fp = fn = tn = 0
    missed = Counter()
    errors = []
    for index, row in enumerate(rows):
        flagged = scan(row["text"], None if vectors is None else vectors[index]).flagged
        injected = row["label"] == "injected"
        tp += flagged and injected
        fp += flagged and not injected
        fn += injected and not flagged
        tn += not flagged and not injected
        if injected and not flagged:
            missed[row["technique"]] += 1
        if flagged != injected:
            errors.append(row)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    return {"n": len(rows), "tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": precision, "recall": recall,
            "missed": missed, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--errors", action="store_true", help="print the lines the scan got wrong")
    args = parser.parse_args()
    from tokenway.embeddings.model import EmbeddingModel

    model = EmbeddingModel()
    for name in ("dev", "test", "holdout"):
        rows = load(name)
        vectors = embed(model, [row["text"] for row in rows])
        for label, result in (("rules", evaluate(rows)), ("rules + probe", evaluate(rows, vectors))):
            print(f"{name} ({'developed on' if name != 'holdout' else 'held out'}), {label}: {result['n']} lines "
                  f"({result['tp'] + result['fn']} injected, {result['fp'] + result['tn']} benign): precision "
                  f"{result['precision']:.3f}, recall {result['recall']:.3f} (tp {result['tp']}, fp {result['fp']}, "
                  f"fn {result['fn']}, tn {result['tn']})")
            if result["missed"]:
                print("  missed by technique: " + ", ".join(f"{k} {v}" for k, v in result["missed"].most_common()))
            if args.errors:
                for row in result["errors"]:
                    finding = scan(row["text"], vectors[rows.index(row)] if label != "rules" else None)
                    print(f"  [{row['label']}/{row['technique']}] score {finding.score} {finding.categories}: "
                          f"{row['text'][:300]!r}")
        texts = [row["text"] for row in rows]
        samples = []
        for _ in range(5):
            for text in texts:
                started = time.perf_counter()
                scan(text)
                samples.append((time.perf_counter() - started) * 1000)
        samples.sort()
        chars = statistics.mean(len(t) for t in texts)
        print(f"  scan: p50 {statistics.median(samples):.3f} ms, p99 {samples[int(len(samples) * 0.99) - 1]:.3f} ms "
              f"(mean {chars:.0f} characters a line)")


if __name__ == "__main__":
    main()
