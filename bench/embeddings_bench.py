"""Embeddings throughput: one caller sending single inputs one after another, against N callers
doing the same at once (EmbeddingEngine batches them), with the batch sizes reached; and the
peer, sentence-transformers' own encode() on the same texts, in the same run.

    python bench/embeddings_bench.py                     # 256 texts of 5..60 words, 16 callers
    python bench/embeddings_bench.py --callers 4 32 --num-threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tokenway.embeddings import EmbeddingEngine, EmbeddingModel, default_model_dir  # noqa: E402

WORDS = ("the model serves requests from many callers while tokens flow through layers of attention and "
         "every batch shares one forward pass on two small cores embeddings measure meaning").split()


def corpus(num_texts: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))).capitalize() + "." for _ in
            range(num_texts)]


def report(label: str, num_texts: int, num_tokens: int, seconds: float, latencies: list[float] | None = None,
           extra: str = "") -> None:
    latency = f"  p50 {statistics.median(latencies) * 1e3:6.1f} ms" if latencies else ""
    print(f"{label:<34} {num_texts / seconds:7.1f} inputs/s {num_tokens / seconds:8.0f} tokens/s{latency}  {extra}")


async def callers(engine: EmbeddingEngine, texts: list[str], num_callers: int) -> list[float]:
    """num_callers tasks, each embedding its share of `texts` one call at a time."""
    latencies: list[float] = []

    async def caller(share: list[str]) -> None:
        for text in share:
            started = time.perf_counter()
            await engine.embed(text)
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(caller(texts[i::num_callers]) for i in range(num_callers)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--callers", type=int, nargs="+", default=[16])
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the model thread")
    parser.add_argument("--max-batch-inputs", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    args = parser.parse_args()

    model = EmbeddingModel()
    texts = corpus(args.texts, random.Random(0))
    num_tokens = sum(len(ids) for ids in model.tokenize(texts))
    print(f"{len(texts)} texts, {num_tokens} tokens (mean {num_tokens / len(texts):.0f}), "
          f"model thread: {args.num_threads} torch thread(s)")

    for num_callers in [1, *args.callers]:
        engine = EmbeddingEngine(model, max_batch_inputs=args.max_batch_inputs,
                                 max_batch_tokens=args.max_batch_tokens, num_threads=args.num_threads)
        asyncio.run(callers(engine, texts[:8], 1))  # warm-up: oneDNN primitives, the thread pool
        warm = engine.stats()
        started = time.perf_counter()
        latencies = asyncio.run(callers(engine, texts, num_callers))
        seconds = time.perf_counter() - started
        stats = engine.stats()
        engine.shutdown()
        num_batches = stats.num_batches - warm.num_batches
        mean_batch = (stats.num_batch_inputs - warm.num_batch_inputs) / num_batches
        label = "sequential single calls" if num_callers == 1 else f"{num_callers} concurrent callers"
        report(label, len(texts), num_tokens, seconds, latencies,
               f"{num_batches} passes, batch mean {mean_batch:.1f} max {stats.max_batch_size}")

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers not installed: no peer figures")
        return
    torch.set_num_threads(args.num_threads)  # the same compute as the model thread had
    reference = SentenceTransformer(str(default_model_dir()), device="cpu")
    reference.encode(texts[:8])
    started = time.perf_counter()
    latencies = []
    for text in texts:
        begun = time.perf_counter()
        reference.encode([text])
        latencies.append(time.perf_counter() - begun)
    report("peer: sentence-transformers, 1 by 1", len(texts), num_tokens, time.perf_counter() - started, latencies)
    for batch_size in (32, len(texts)):
        started = time.perf_counter()
        reference.encode(texts, batch_size=batch_size)
        report(f"peer: sentence-transformers, bs {batch_size}", len(texts), num_tokens, time.perf_counter() - started)


if __name__ == "__main__":
    main()
