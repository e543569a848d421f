"""Shared by the embeddings tests: the model (loaded once), sentence-transformers' own model
from the same directory as the reference, and a model double whose forward passes wait at a
gate, so that what a test queues while one pass runs is decided by the test, not by timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tokenway.embeddings import EmbeddingModel, default_model_dir

# Mixed lengths, case, punctuation and scripts; the longest is 100+ tokens, the shortest 3.
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "A self-hosted LLM API stack serves chat completions and embeddings on two CPU cores. " * 6,
    "Café, naïve, résumé: accents are stripped by the uncased tokenizer.",
    "日本語のテキストと中文文本",
    "Emoji 🙂🚀 and symbols ∑∫√ become [UNK] or pieces",
    "שלום עולם — مرحبا بالعالم",
    "Zero\u200bwidth and combining e\u0301 characters",
    "   leading and trailing whitespace   ",
    "x",
]


@pytest.fixture(scope="session")
def model() -> EmbeddingModel:
    return EmbeddingModel()


@pytest.fixture(scope="session")
def reference():
    """sentence-transformers' SentenceTransformer on the same directory: what the vectors must equal."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(default_model_dir()), device="cpu")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two (n, d) arrays."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


class GatedModel:
    """Wraps a model: each forward pass records its batch and thread, then waits for `gate`."""

    def __init__(self, inner: EmbeddingModel, *, fail_next: bool = False) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = fail_next
        self.batches: list[list[list[int]]] = []
        self.thread_ids: list[int] = []
        self.num_threads_seen: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # dimensions, vocab_size, max_input_tokens, tokenize

    def embed_token_ids(self, batch: list[list[int]]) -> np.ndarray:
        self.batches.append(batch)
        self.thread_ids.append(threading.get_ident())
        self.num_threads_seen.append(torch.get_num_threads())
        assert self.gate.wait(timeout=60), "a test left the gate shut"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("forward pass failed")
        return self.inner.embed_token_ids(batch)


async def wait_until(condition: Callable[[], bool]) -> None:
    """Yields to the loop until `condition` holds; a guard against a hang, not a timing check."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")
