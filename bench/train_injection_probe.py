"""Trains the injection scan's embedding probe (tokenway/client/injection_probe.json): a
logistic regression on all-MiniLM-L6-v2 vectors (the server's /v1/embeddings model, computed
here by the same code) of the development sets, tests/fixtures/injection/dev.jsonl and
test.jsonl. holdout.jsonl is never read here: it is what bench/injection_bench.py reports.

    python bench/train_injection_probe.py           # writes the probe, prints the cross-validation

The threshold is chosen without the holdout: the lowest of 0.50, 0.55, ... 0.95 at which the
probe alone reaches 0.90 precision on 5-fold cross-validation of the development sets (the
rules already flag the obvious; the probe is there to add what they miss without adding
false alarms).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenway.client.injection import PROBE_PATH  # noqa: E402  (after the sys.path line)
from tokenway.embeddings.model import EmbeddingModel  # noqa: E402

SETS = ROOT / "tests" / "fixtures" / "injection"
L2, STEP, ITERATIONS, FOLDS, MIN_PRECISION = 1e-3, 2.0, 3000, 5, 0.90


def embed(model: EmbeddingModel, texts: list[str]) -> np.ndarray:
    """(len(texts), 384) unit vectors; a text over the model's 256 tokens is cut there (its
    [SEP] kept), as a caller embedding a chunk of at most 256 tokens sees it."""
    ids = [row if len(row) <= model.max_input_tokens else row[:model.max_input_tokens - 1] + row[-1:]
           for row in model.tokenize(texts)]
    return np.concatenate([model.embed_token_ids(ids[i:i + 32]) for i in range(0, len(ids), 32)])


def fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Logistic regression by full-batch gradient descent, L2-regularised (deterministic)."""
    weights, bias = np.zeros(x.shape[1]), 0.0
    for _ in range(ITERATIONS):
        p = 1.0 / (1.0 + np.exp(-(x @ weights + bias)))
        weights -= STEP * (x.T @ (p - y) / len(y) + L2 * weights)
        bias -= STEP * float(np.mean(p - y))
    return weights, bias


def main() -> None:
    rows = [json.loads(line) for name in ("dev", "test") for line in (SETS / f"{name}.jsonl").read_text().splitlines()]
    x = embed(EmbeddingModel(), [row["text"] for row in rows])
    y = np.array([row["label"] == "injected" for row in rows], dtype=np.float64)
    order = np.random.default_rng(0).permutation(len(rows))
    out_of_fold = np.zeros(len(rows))
    for fold in np.array_split(order, FOLDS):
        train = np.ones(len(rows), dtype=bool)
        train[fold] = False
        weights, bias = fit(x[train], y[train])
        out_of_fold[fold] = 1.0 / (1.0 + np.exp(-(x[fold] @ weights + bias)))
    threshold, table = None, []
    for candidate in np.arange(0.50, 0.951, 0.05):
        flagged = out_of_fold >= candidate
        tp = float((flagged & (y == 1)).sum())
        precision, recall = tp / max(flagged.sum(), 1), tp / y.sum()
        table.append((round(float(candidate), 2), round(precision, 3), round(recall, 3)))
        if threshold is None and precision >= MIN_PRECISION:
            threshold = round(float(candidate), 2)
    for candidate, precision, recall in table:
        print(f"threshold {candidate:.2f}: cross-validated precision {precision:.3f}, recall {recall:.3f}")
    weights, bias = fit(x, y)
    probe = {"model": "all-minilm-l6-v2", "dimensions": int(x.shape[1]), "threshold": threshold,
             "bias": round(bias, 6), "weights": [round(float(w), 6) for w in weights],
             "trained_on": ["dev.jsonl", "test.jsonl"], "lines": len(rows),
             "cross_validation": [{"threshold": t, "precision": p, "recall": r} for t, p, r in table]}
    PROBE_PATH.write_text(json.dumps(probe) + "\n")
    print(f"threshold {threshold} -> {PROBE_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
