"""The ledger's PostgreSQL backend (psycopg 3): same table and semantics as SqliteStore."""

from __future__ import annotations

from collections.abc import Sequence
from typing import LiteralString

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from tokenway.billing.record import COLUMNS, UsageRecord
from tokenway.billing.store import USAGE_COUNTS, USAGE_FIELDS, USAGE_GROUPS, usage_filter
from tokenway.sql import pg_timeouts

# Any constant: serializes CREATE TABLE IF NOT EXISTS between gateways starting together
# (concurrent creates of one table can fail on the catalog's unique index).
_SCHEMA_LOCK_ID = 0x70C3_BA11
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_ledger (
    request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd DOUBLE PRECISION NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL,
    stages_ms JSONB NOT NULL, started_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL);
ALTER TABLE usage_ledger ADD COLUMN IF NOT EXISTS trace JSONB NOT NULL DEFAULT '{}';
ALTER TABLE usage_ledger ADD COLUMN IF NOT EXISTS reasoning_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN IF NOT EXISTS service_tier TEXT NOT NULL DEFAULT 'default';
CREATE INDEX IF NOT EXISTS usage_ledger_key_finished ON usage_ledger (key_id, finished_at);
CREATE INDEX IF NOT EXISTS usage_ledger_finished ON usage_ledger (finished_at);
"""
_INSERT: LiteralString = (f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES ({', '.join('%s' for _ in COLUMNS)})"
           " ON CONFLICT (request_id) DO NOTHING RETURNING request_id")
_DAY = "to_char(to_timestamp(finished_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


class PostgresStore:
    def __init__(self, url: str) -> None:
        # autocommit: reads leave no transaction open; writes use explicit transaction blocks.
        self._conn = psycopg.connect(url, autocommit=True, **pg_timeouts(conninfo_to_dict(url)))
        with self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_ID,))
            self._conn.execute(_SCHEMA)

    def insert(self, records: Sequence[UsageRecord]) -> list[UsageRecord]:
        written = []
        with self._conn.transaction(), self._conn.cursor() as cur:
            # One round trip (psycopg pipelines executemany); one result set per row, in order,
            # holding the request_id only when that row was new.
            cur.executemany(_INSERT, [rec.to_row(Jsonb) for rec in records], returning=True)
            for rec, _ in zip(records, cur.results()):
                if cur.fetchone() is not None:
                    written.append(rec)
        return written

    def spend_usd(self, key_id: str) -> float:
        row = self._conn.execute("SELECT COALESCE(SUM(cost_usd), 0.0) FROM usage_ledger WHERE key_id = %s",
                                 (key_id,)).fetchone()
        assert row is not None  # an aggregate without GROUP BY is one row
        return row[0]

    def usage(self, key_id: str | None, since: float | None, until: float | None) -> list[dict]:
        where, params = usage_filter(key_id, since, until, "%s")
        rows = self._conn.execute(
            f"SELECT key_id, {_DAY} AS day, model, service_tier, {USAGE_COUNTS}, SUM(prompt_tokens)::bigint,"
            " SUM(cached_tokens)::bigint, SUM(completion_tokens)::bigint, SUM(reasoning_tokens)::bigint,"
            " SUM(cost_usd) FROM usage_ledger" + where +
            f" GROUP BY {USAGE_GROUPS} ORDER BY {USAGE_GROUPS}", params).fetchall()
        return [dict(zip(USAGE_FIELDS, row)) for row in rows]

    def get(self, request_id: str) -> UsageRecord | None:
        row = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_ledger WHERE request_id = %s",
                                 (request_id,)).fetchone()
        return None if row is None else UsageRecord(*row)  # psycopg decodes jsonb into a dict

    def recent(self, limit: int) -> list[UsageRecord]:
        rows = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY finished_at DESC LIMIT %s",
                                  (limit,)).fetchall()
        return [UsageRecord(*row) for row in rows]

    def close(self) -> None:
        self._conn.close()
