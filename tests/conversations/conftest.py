"""The response store's fixtures: a store on each backend (SQLite in a temp file, the in-memory
store, a fresh database on the session's real PostgreSQL from scripts/postgres.sh, skipped
with the reason where it cannot start), and make_response, a stored response as the API makes one."""

import subprocess

import pytest

from tokenway.conversations import StoredResponse, open_response_store


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make_response(response_id: str, *, key_id: str = "key-a", previous_response_id: str | None = None,
                  status: str = "completed", text: str = "hello", num_items: int = 1,
                  instructions: str | None = None, metadata: dict[str, str] | None = None) -> StoredResponse:
    items = tuple({"id": f"msg_{response_id}_{i}", "type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": f"{text} #{i}"}]} for i in range(num_items))
    return StoredResponse(response_id, key_id, 1_750_000_000.25, status, "m1", previous_response_id, instructions,
                          items, render(response_id, status, f"an answer to {text}", previous_response_id),
                          metadata or {})


def render(response_id: str, status: str, text: str, previous_response_id: str | None = None) -> dict:
    """A Response object as the API renders it."""
    return {"id": response_id, "object": "response", "created_at": 1_750_000_000, "status": status, "model": "m1",
            "previous_response_id": previous_response_id,
            "output": [{"id": f"msg_out_{response_id}", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19}}


@pytest.fixture(params=["sqlite", "memory", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/responses.db"
    if request.param == "memory":
        return "memory"
    try:
        return request.getfixturevalue("postgres_database")  # tests/conftest.py
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"no PostgreSQL: scripts/postgres.sh start failed: {(exc.stderr or b'').strip()[-300:]!r}")


@pytest.fixture
async def store(store_url):
    store = open_response_store(store_url)
    yield store
    await store.close()
