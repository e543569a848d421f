"""Reasoning tokens in the ledger, both backends: a row's count reads back and usage sums it; a
ledger made before the column existed gains it on start (its rows count 0); a journal line
written before it reads back."""

import json
import sqlite3

import psycopg
import pytest

from tokenway.billing.journal import parse_line
from tokenway.billing.ledger import Ledger
from tokenway.billing.record import COLUMNS

from .conftest import DAY1, make_record

pytestmark = pytest.mark.anyio

# The table as the ledger made it before reasoning tokens were kept, in each backend.
OLD_SQLITE = """CREATE TABLE usage_ledger (request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL, stages_ms TEXT NOT NULL,
    started_at REAL NOT NULL, finished_at REAL NOT NULL, trace TEXT NOT NULL DEFAULT '{}')"""
OLD_POSTGRES = """CREATE TABLE usage_ledger (request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cost_usd DOUBLE PRECISION NOT NULL, finish_reason TEXT, error TEXT, status INTEGER NOT NULL,
    stages_ms JSONB NOT NULL, started_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL,
    trace JSONB NOT NULL DEFAULT '{}')"""
OLD_ROW = ("old-1", "key-a", "m1", 10, 0, 5, 0.25, "stop", None, 200, '{"decode": 1.0}', DAY1 - 1, DAY1, "{}")


async def test_reasoning_tokens_read_back_and_are_summed_in_usage(url):
    async with Ledger(url) as ledger:
        await ledger.record(make_record("r1", completion_tokens=40, reasoning_tokens=31))
        await ledger.record(make_record("r2", completion_tokens=9, reasoning_tokens=0))
        await ledger.record(make_record("r3", completion_tokens=12, reasoning_tokens=12))
        first = await ledger.get("r1")
        assert first is not None and first.reasoning_tokens == 31
        [row] = await ledger.usage("key-a")
        assert (row["completion_tokens"], row["reasoning_tokens"]) == (61, 43)


async def test_a_ledger_from_before_reasoning_tokens_gains_the_column(url):
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as conn:
            conn.execute(OLD_SQLITE)
            conn.execute("INSERT INTO usage_ledger VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", OLD_ROW)
    else:
        with psycopg.connect(url) as conn:
            conn.execute(OLD_POSTGRES)
            conn.execute("INSERT INTO usage_ledger VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                         OLD_ROW)
    async with Ledger(url) as ledger:
        old = await ledger.get("old-1")
        assert old is not None and (old.completion_tokens, old.reasoning_tokens) == (5, 0)
        await ledger.record(make_record("new-1", completion_tokens=20, reasoning_tokens=15))
        new = await ledger.get("new-1")
        assert new is not None and new.reasoning_tokens == 15
        [row] = await ledger.usage("key-a")
        assert (row["requests"], row["completion_tokens"], row["reasoning_tokens"]) == (2, 25, 15)


def test_a_journal_line_from_before_reasoning_tokens_reads_back():
    line = make_record("j1").to_row()
    fields = dict(zip(COLUMNS, line))
    del fields["reasoning_tokens"]
    fields["stages_ms"], fields["trace"] = {"decode": 1.0}, {}
    record = parse_line(json.dumps(fields).encode(), "journal line 2", None)
    assert record is not None and record.reasoning_tokens == 0 and record.completion_tokens == 5


def test_a_negative_count_is_no_row():
    with pytest.raises(ValueError, match=">= 0"):
        make_record("bad", reasoning_tokens=-1)
