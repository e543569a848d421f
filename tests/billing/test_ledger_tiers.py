"""The service tier in the ledger, both backends: a row's tier reads back and usage sums each
tier apart; a ledger made before the column existed gains it on start (its rows are
"default"); a journal line written before it reads back."""

import json
import sqlite3

import psycopg
import pytest

from tokenway.billing.journal import parse_line
from tokenway.billing.ledger import Ledger
from tokenway.billing.record import COLUMNS

from .conftest import DAY1, make_record

pytestmark = pytest.mark.anyio

# The table as the ledger made it before service tiers were kept, in each backend.
OLD_SQLITE = """CREATE TABLE usage_ledger (request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL, stages_ms TEXT NOT NULL,
    started_at REAL NOT NULL, finished_at REAL NOT NULL, trace TEXT NOT NULL DEFAULT '{}',
    reasoning_tokens INTEGER NOT NULL DEFAULT 0)"""
OLD_POSTGRES = """CREATE TABLE usage_ledger (request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd DOUBLE PRECISION NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL,
    stages_ms JSONB NOT NULL, started_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL,
    trace JSONB NOT NULL DEFAULT '{}', reasoning_tokens INTEGER NOT NULL DEFAULT 0)"""
OLD_ROW = ("old-1", "key-a", "m1", 10, 0, 5, 0.25, "stop", None, 200, '{"decode": 1.0}', DAY1 - 1, DAY1, "{}", 0)


async def test_a_ledger_from_before_tiers_gains_the_column_and_sums_each_tier_apart(url):
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as conn:
            conn.execute(OLD_SQLITE)
            conn.execute(f"INSERT INTO usage_ledger VALUES ({', '.join('?' * len(OLD_ROW))})", OLD_ROW)
    else:
        with psycopg.connect(url) as conn:
            conn.execute(OLD_POSTGRES)
            conn.execute(f"INSERT INTO usage_ledger VALUES ({', '.join(['%s'] * len(OLD_ROW))})", OLD_ROW)
    async with Ledger(url) as ledger:
        old = await ledger.get("old-1")
        assert old is not None and old.service_tier == "default"
        await ledger.record(make_record("new-1", cost_usd=0.125, service_tier="batch"))
        await ledger.record(make_record("new-2", cost_usd=0.5, service_tier="default"))
        new = await ledger.get("new-1")
        assert new is not None and new.service_tier == "batch"
        rows = await ledger.usage("key-a")
        assert [(row["service_tier"], row["requests"], row["cost_usd"]) for row in rows] == [
            ("batch", 1, 0.125), ("default", 2, 0.75)]


def test_a_journal_line_from_before_tiers_reads_back_as_default():
    fields = dict(zip(COLUMNS, make_record("j1").to_row()))
    del fields["service_tier"]
    fields["stages_ms"], fields["trace"] = {"decode": 1.0}, {}
    record = parse_line(json.dumps(fields).encode(), "journal line 2", None)
    assert record is not None and record.service_tier == "default"
