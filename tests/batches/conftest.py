"""The batch store's fixtures: a store on each backend (SQLite in a temp file, the in-memory
store, a fresh database on the session's real PostgreSQL from scripts/postgres.sh, skipped with
the reason where it cannot start), and helpers that make batches as the APIs do."""

import subprocess
import time

import pytest

from tokenway.batches import Batch, BatchStore, LineOutcome, new_batch, open_batch_store

NOW = 1_750_000_000.0


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(params=["sqlite", "memory", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/ledger.db"
    if request.param == "memory":
        return "memory"
    return postgres_url(request)


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request, tmp_path):
    """A database two stores (two gateways) can share."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/ledger.db"
    return postgres_url(request)


def postgres_url(request) -> str:
    try:
        return request.getfixturevalue("postgres_database")  # tests/conftest.py
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"no PostgreSQL: scripts/postgres.sh start failed: {(exc.stderr or b'').strip()[-300:]!r}")


@pytest.fixture
async def store(store_url):
    store = open_batch_store(store_url)
    yield store
    await store.close()


def chat_body(i: int) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": f"question {i} ✓"}], "max_tokens": 8}


async def make_batch(store: BatchStore, num_lines: int, *, key_id: str = "key-a", api: str = "openai",
                     now: float = NOW, completion_window_s: float = 24 * 3600.0) -> Batch:
    endpoint = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    batch = new_batch(api, key_id, endpoint, now=now, input_file_id="file-" + "a" * 24 if api == "openai" else None,
                      metadata={"job": "tests"}, completion_window_s=completion_window_s)
    return await store.create_batch(batch, [(f"req-{i}", chat_body(i)) for i in range(num_lines)])


def chat_completion(i: int) -> dict:
    """An answer as /v1/chat/completions gives it."""
    return {"id": f"chatcmpl-{i}", "object": "chat.completion", "created": int(NOW), "model": "m1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {i}"},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def message(i: int) -> dict:
    """An answer as /v1/messages gives it."""
    return {"id": f"msg_{i}", "type": "message", "role": "assistant", "model": "m1",
            "content": [{"type": "text", "text": f"answer {i}"}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 2}}


def succeeded(i: int, api: str = "openai") -> LineOutcome:
    return LineOutcome("succeeded", 200, message(i) if api == "anthropic" else chat_completion(i), None, f"req_{i}")


def wall_now() -> float:
    return time.time()
