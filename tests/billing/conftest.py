"""The ledger's fixtures: a row factory, and both backends, SQLite in a temp file and a real
PostgreSQL server started by scripts/postgres.sh for the session (a fresh database per test)."""

from calendar import timegm

import pytest

from tokenway.billing.ledger import UsageRecord

DAY1 = timegm((2024, 3, 1, 23, 59, 59))  # the last second of a UTC day...
DAY2 = DAY1 + 1  # ...and the first of the next


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make_record(request_id: str, key_id: str = "key-a", model: str = "m1", prompt_tokens: int = 10,
                cached_tokens: int = 0, completion_tokens: int = 5, cost_usd: float = 0.25,
                finished_at: float = DAY1, **overrides) -> UsageRecord:
    fields = {"finish_reason": "stop", "error": None, "status": 200, "stages_ms": {"gateway": 0.5, "decode": 12.0},
              "started_at": finished_at - 1.5}
    fields.update(overrides)
    return UsageRecord(request_id, key_id, model, prompt_tokens, cached_tokens, completion_tokens, cost_usd,
                       finished_at=finished_at, **fields)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/ledger.db"
    return request.getfixturevalue("postgres_database")  # tests/conftest.py
