"""The ledger's SQLite backend (the default): WAL, synchronous=NORMAL, so a commit survives a
killed process though not a power cut."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from tokenway.billing.record import COLUMNS, UsageRecord
from tokenway.billing.store import USAGE_COUNTS, USAGE_FIELDS, USAGE_GROUPS, usage_filter

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_ledger (
    request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL,
    stages_ms TEXT NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL,
    trace TEXT NOT NULL DEFAULT '{}', reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    service_tier TEXT NOT NULL DEFAULT 'default');
CREATE INDEX IF NOT EXISTS usage_ledger_key_finished ON usage_ledger (key_id, finished_at);
CREATE INDEX IF NOT EXISTS usage_ledger_finished ON usage_ledger (finished_at);
"""


class SqliteStore:
    def __init__(self, path: str) -> None:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves; the file may be shared with
        # other modules' tables, so wait for their write locks instead of failing.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA busy_timeout = 10000")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = NORMAL")
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(usage_ledger)")}
        if columns and "trace" not in columns:  # a ledger from before traces were kept
            self._conn.execute("ALTER TABLE usage_ledger ADD COLUMN trace TEXT NOT NULL DEFAULT '{}'")
        if columns and "reasoning_tokens" not in columns:  # ... and before reasoning tokens were
            self._conn.execute("ALTER TABLE usage_ledger ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0")
        if columns and "service_tier" not in columns:  # ... and before service tiers were
            self._conn.execute("ALTER TABLE usage_ledger ADD COLUMN service_tier TEXT NOT NULL DEFAULT 'default'")
        self._conn.executescript(_SQLITE_SCHEMA)
        self._insert_sql = (f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
                            " ON CONFLICT (request_id) DO NOTHING")

    def insert(self, records: Sequence[UsageRecord]) -> list[UsageRecord]:
        written = []
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            for rec in records:
                if self._conn.execute(self._insert_sql, rec.to_row()).rowcount == 1:
                    written.append(rec)
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        return written

    def spend_usd(self, key_id: str) -> float:
        return self._conn.execute("SELECT COALESCE(SUM(cost_usd), 0.0) FROM usage_ledger WHERE key_id = ?",
                                  (key_id,)).fetchone()[0]

    def usage(self, key_id: str | None, since: float | None, until: float | None) -> list[dict]:
        where, params = usage_filter(key_id, since, until, "?")
        rows = self._conn.execute(
            f"SELECT key_id, date(finished_at, 'unixepoch') AS day, model, service_tier, {USAGE_COUNTS},"
            " SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), SUM(reasoning_tokens), SUM(cost_usd)"
            " FROM usage_ledger" + where + f" GROUP BY {USAGE_GROUPS} ORDER BY {USAGE_GROUPS}", params).fetchall()
        return [dict(zip(USAGE_FIELDS, row)) for row in rows]

    def get(self, request_id: str) -> UsageRecord | None:
        row = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_ledger WHERE request_id = ?",
                                 (request_id,)).fetchone()
        return None if row is None else UsageRecord.from_row(row)

    def recent(self, limit: int) -> list[UsageRecord]:
        rows = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY finished_at DESC LIMIT ?",
                                  (limit,)).fetchall()
        return [UsageRecord.from_row(row) for row in rows]

    def close(self) -> None:
        self._conn.close()
