"""The ledger's fixtures: a row factory, and both backends, SQLite in a temp file and a real
PostgreSQL server started by scripts/postgres.sh for the session (a fresh database per test);
and a PostgreSQL of the tests' own, which they stop and start again."""

import os
import socket
import subprocess
import uuid
from calendar import timegm
from pathlib import Path

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


class OwnPostgres:
    """A PostgreSQL server of one's own, from scripts/postgres.sh on its own port and directory,
    for tests that stop it: the session's shared server may be serving other tests meanwhile."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._env = {**os.environ, "TOKENWAY_PG_DIR": str(directory), "TOKENWAY_PG_PORT": str(port)}
        self.url = self.start()

    def _script(self, command: str) -> str:
        script = Path(__file__).resolve().parents[2] / "scripts" / "postgres.sh"
        return subprocess.run([script, command], env=self._env, check=True, capture_output=True,
                              text=True).stdout.strip()

    def start(self) -> str:
        return self._script("start")

    def stop(self) -> None:
        self._script("stop")

    def new_database(self) -> str:
        import psycopg

        name = f"test_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def own_postgres(tmp_path_factory):
    pytest.importorskip("psycopg", reason="the PostgreSQL backend needs psycopg 3")
    server = OwnPostgres(tmp_path_factory.mktemp("own-postgres"))
    yield server
    server.stop()
