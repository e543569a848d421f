"""Response-store benchmark: what continuing a stored conversation (previous_response_id) costs.

    python bench/response_store_bench.py                        # SQLite file and the in-memory store
    python bench/response_store_bench.py --backends sqlite,postgresql --turns 1,10,50,200

For each backend and conversation length: chain() (one recursive query, off the event loop, as
the API calls it), p50 and p99 over --repeat calls; the peer is the walk it replaces, one get()
per turn from the newest back. Each turn is a user message of ~300 characters and an answer of
~800 in a full Response object, as the API stores them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenway.conversations import StoredResponse, open_response_store  # noqa: E402  (after the sys.path line)
from tokenway.conversations.store import ResponseStore  # noqa: E402

QUESTION = "Summarize the trade-offs of paged attention versus contiguous KV caches for a serving system. " * 3
ANSWER = ("Paged attention stores keys and values in fixed-size blocks, so memory is allocated on demand and "
          "shared prefixes can be reused across requests; the cost is an indirection per block. ") * 4


def make_turn(response_id: str, previous_response_id: str | None) -> StoredResponse:
    response = {"id": response_id, "object": "response", "created_at": 1_750_000_000, "status": "completed",
                "model": "smollm2-135m-instruct", "previous_response_id": previous_response_id, "instructions": None,
                "output": [{"id": f"msg_{response_id}", "type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}],
                "temperature": 1.0, "top_p": 1.0, "tools": [], "tool_choice": "auto",
                "text": {"format": {"type": "text"}},
                "usage": {"input_tokens": 412, "output_tokens": 181, "total_tokens": 593}, "metadata": {}}
    items = ({"id": f"msg_in_{response_id}", "type": "message", "role": "user",
              "content": [{"type": "input_text", "text": QUESTION}]},)
    return StoredResponse(response_id, "key-bench", time.time(), "completed", "smollm2-135m-instruct",
                          previous_response_id, None, items, response, {})


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def timed(call, repeat: int) -> list[float]:
    await call()  # the connection opened, the statements prepared
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        await call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


async def walk(store: ResponseStore, response_id: str) -> None:
    next_id: str | None = response_id
    while next_id is not None:
        stored = await store.get(next_id, "key-bench")
        assert stored is not None
        next_id = stored.previous_response_id


async def bench(name: str, url: str, turns: list[int], repeat: int) -> None:
    store = open_response_store(url)
    try:
        ids = [f"resp_{i:06d}" for i in range(max(turns))]
        for i, response_id in enumerate(ids):
            await store.create(make_turn(response_id, ids[i - 1] if i else None))
        for num_turns in turns:
            head = ids[num_turns - 1]
            assert len(await store.chain(head, "key-bench")) == num_turns
            chain_ms = await timed(lambda head=head: store.chain(head, "key-bench"), repeat)
            walk_ms = await timed(lambda head=head: walk(store, head), max(1, repeat // 4))
            print(f"{name:<12}{num_turns:>6}{percentile(chain_ms, 50):>12.3f}{percentile(chain_ms, 99):>12.3f}"
                  f"{percentile(walk_ms, 50):>14.3f}{percentile(walk_ms, 50) / percentile(chain_ms, 50):>9.1f}x",
                  flush=True)
    finally:
        await store.close()


@contextlib.contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A database of its own on scripts/postgres.sh's server, dropped after the run."""
    import psycopg

    server = subprocess.run([REPO / "scripts" / "postgres.sh", "start"], check=True, capture_output=True,
                            text=True).stdout.strip()
    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield server.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,memory", help="comma-separated: sqlite, memory, postgresql")
    parser.add_argument("--turns", default="1,10,50", help="conversation lengths, comma-separated")
    parser.add_argument("--repeat", type=int, default=400, help="chain() calls timed per length")
    args = parser.parse_args()
    turns = [int(n) for n in args.turns.split(",")]
    print(f"{'backend':<12}{'turns':>6}{'chain p50':>12}{'chain p99':>12}{'get walk p50':>14}{'ratio':>10}"
          "   (ms; the walk: one get() per turn)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.backends.split(","):
            if name == "sqlite":
                url = f"sqlite://{tmp}/responses.db"
            elif name == "memory":
                url = "memory"
            elif name == "postgresql":
                with fresh_postgres_database() as url:
                    asyncio.run(bench(name, url, turns, args.repeat))
                continue
            else:
                raise SystemExit(f"unknown backend {name!r}")
            asyncio.run(bench(name, url, turns, args.repeat))


if __name__ == "__main__":
    main()
