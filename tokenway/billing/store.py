"""What a ledger backend is (LedgerStore), which of its failures are outages, and the SQL both
backends share. The backends: ledger_sqlite.py (the default) and ledger_postgres.py (at scale)."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Sequence
from typing import LiteralString, Protocol

from tokenway.billing.record import UsageRecord

USAGE_FIELDS = ("key_id", "day", "model", "service_tier", "requests", "refused_requests", "prompt_tokens",
                "cached_tokens", "completion_tokens", "reasoning_tokens", "cost_usd")
# What usage() sums by, and orders by: the first four USAGE_FIELDS.
USAGE_GROUPS: LiteralString = "key_id, day, model, service_tier"
# A refusal is a call answered 4xx before anything ran: no token counted. A 499 (the client
# left) and a 5xx are billed for whatever they used, and count among the requests served.
_REFUSED = "status BETWEEN 400 AND 498 AND prompt_tokens = 0 AND completion_tokens = 0"
# usage()'s two counts, in USAGE_FIELDS order; the same SQL for SQLite (3.30+) and PostgreSQL.
USAGE_COUNTS: LiteralString = f"COUNT(*) FILTER (WHERE NOT ({_REFUSED})), COUNT(*) FILTER (WHERE {_REFUSED})"


class LedgerUnavailable(Exception):
    """The ledger's database cannot be reached, and what was asked needs it (a key's committed
    spend not read before, usage). `retry_after_s`: when the ledger next tries it.
    Rows are never refused for this: they wait (in the journal) and are committed once it is back."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LedgerStore(Protocol):
    """One connection to one backend. Used from one thread at a time."""

    def insert(self, records: Sequence[UsageRecord]) -> list[UsageRecord]:
        """Insert in one transaction and commit; return the records actually written (not duplicates)."""
        ...

    def spend_usd(self, key_id: str) -> float: ...

    def usage(self, key_id: str | None, since: float | None, until: float | None) -> list[dict]:
        """Rows of USAGE_FIELDS, by key, UTC day (of finished_at), model and service tier."""
        ...

    def get(self, request_id: str) -> UsageRecord | None: ...

    def recent(self, limit: int) -> list[UsageRecord]:
        """The last `limit` rows by finished_at, newest first."""
        ...

    def close(self) -> None: ...


def open_store(url: str) -> LedgerStore:
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path or path == "/:memory:":
            raise ValueError(f"ledger url {url!r}: use sqlite:///absolute/path.db (a file both connections share)")
        from tokenway.billing.ledger_sqlite import SqliteStore

        return SqliteStore(path)
    if url.startswith(("postgresql://", "postgres://")):
        from tokenway.billing.ledger_postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(f"ledger url {url!r}: expected sqlite:///path.db or postgresql://...")


def is_row_fault(exc: BaseException) -> bool:
    """A failure caused by a row's values (quarantine that row), as opposed to anything else: the
    database down or restarting, a failover to a read-only replica, a permission lost (keep the
    rows, retry until it takes them). Only a value the backend refuses counts: client-side
    adaptation (OverflowError for an int no column holds), SQLSTATE classes 22 and 23."""
    if isinstance(exc, (ValueError, TypeError, OverflowError, sqlite3.DataError, sqlite3.IntegrityError,
                        sqlite3.InterfaceError)):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and (isinstance(exc, (psycopg.DataError, psycopg.IntegrityError))
                                    # psycopg is looked up, not imported: its classes do not narrow exc.
                                    or isinstance(exc, psycopg.ProgrammingError)
                                    and getattr(exc, "sqlstate", None) is None)


def usage_filter(key_id: str | None, since: float | None, until: float | None,
                 mark: LiteralString) -> tuple[LiteralString, list]:
    """The WHERE clause of usage(): since inclusive, until exclusive, on finished_at. Literal
    text alone (the values go in params), as psycopg's typing asks of a query."""
    conditions: list[LiteralString] = []
    params = []
    filters: tuple[tuple[LiteralString, object], ...] = (
        ("key_id = ", key_id), ("finished_at >= ", since), ("finished_at < ", until))
    for condition, value in filters:
        if value is not None:
            conditions.append(condition + mark)
            params.append(value)
    return (" WHERE " + " AND ".join(conditions)) if conditions else "", params
