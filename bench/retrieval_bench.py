"""What the vector stores of tokenway.client cost: adding N random 384-dimensional vectors and
searching them (k=4, one namespace) in SqliteVecStore and in PostgresVectorStore, exact mode
(a real[] column, cosine in SQL) and pgvector mode (HNSW) where the server has the extension.

    python bench/retrieval_bench.py [N]       # N = 5000; PostgreSQL from scripts/postgres.sh

Searching through a Retriever adds the query's embedding (one /v1/embeddings call, ~20 ms
for all-MiniLM-L6-v2 on two cores), which dominates a search of a small store.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenway.client.vectors import Item, PostgresVectorStore, SqliteVecStore  # noqa: E402  (after sys.path)


def run(name: str, store, vectors: np.ndarray, queries: np.ndarray) -> None:
    items = [Item(f"id{i}", vectors[i], f"text {i}", f"source-{i % 50}", "docs") for i in range(len(vectors))]
    started = time.perf_counter()
    for i in range(0, len(items), 500):
        store.add(items[i:i + 500])
    seconds = time.perf_counter() - started
    samples = []
    for query in queries:
        started = time.perf_counter()
        store.search(query, 4, namespace="docs")
        samples.append((time.perf_counter() - started) * 1000)
    print(f"{name}: add {len(items) / seconds:,.0f} vectors/s; search k=4 p50 {statistics.median(samples):.2f} ms, "
          f"max {max(samples):.2f} ms ({len(queries)} queries, {len(items):,} vectors)")


def main() -> None:
    num_vectors = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(num_vectors, 384)).astype(np.float32)
    queries = rng.normal(size=(30, 384)).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder, SqliteVecStore(str(Path(folder) / "bench.db")) as store:
        run("sqlite-vec (file)", store, vectors, queries)
    import psycopg

    server = subprocess.run([str(ROOT / "scripts" / "postgres.sh"), "start"], check=True, capture_output=True,
                            text=True).stdout.strip()
    for mode in ("exact", "pgvector"):
        name = f"bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        try:
            with PostgresVectorStore(server.rsplit("/", 1)[0] + "/" + name, mode=mode) as store:
                run(f"PostgreSQL, {mode}", store, vectors, queries)
        except (ValueError, psycopg.Error) as exc:
            print(f"PostgreSQL, {mode}: not measured ({str(exc).splitlines()[0]})")
        finally:
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
