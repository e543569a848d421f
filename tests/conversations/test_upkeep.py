"""The response store's upkeep on every backend (SQLite, in memory, a real PostgreSQL): leases
of running responses are renewed, a running response whose lease passed is stored failed once
(and one renewed in time is not), purge deletes the finished responses made before a time and
keeps the running ones; a database made before leases existed gains the column."""

import sqlite3
from dataclasses import replace

import pytest

from tokenway.conversations import open_response_store, parse_duration

from .conftest import make_response, render

pytestmark = pytest.mark.anyio

NOW = 1_750_000_100.0


def abandon(response):
    return {**response, "status": "failed", "error": {"code": "server_error", "message": "gone"}}


async def test_a_running_response_whose_lease_passed_is_failed_once(store):
    await store.create(replace(make_response("resp_held", status="in_progress"), lease_until=NOW + 30))
    await store.create(replace(make_response("resp_gone", status="in_progress"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_queued", status="queued"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_old", status="in_progress"), created_at=NOW - 3601))  # no lease
    await store.create(make_response("resp_unleased", status="in_progress"))  # ... and may still run: made just now
    await store.create(replace(make_response("resp_done"), lease_until=NOW - 1))  # finished: not running
    assert sorted(await store.expire(NOW, abandon)) == ["resp_gone", "resp_old", "resp_queued"]
    gone = await store.get("resp_gone", "key-a")
    assert gone.status == gone.response["status"] == "failed" and gone.response["error"]["message"] == "gone"
    assert gone.response["output"] == render("resp_gone", "in_progress", "an answer to hello")["output"]
    assert (await store.get("resp_held", "key-a")).status == (await store.get("resp_unleased", "key-a")).status \
        == "in_progress"
    assert (await store.get("resp_done", "key-a")).status == "completed"
    assert await store.expire(NOW, abandon) == ()  # once


async def test_a_renewed_lease_keeps_a_running_response(store):
    await store.create(replace(make_response("resp_a", status="in_progress"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_b", status="queued"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_c"), lease_until=NOW - 1))
    assert await store.renew(("resp_a", "resp_b", "resp_c", "resp_missing"), NOW + 60) == 2  # the running ones
    assert await store.renew((), NOW + 60) == 0
    assert await store.expire(NOW, abandon) == ()
    assert (await store.get("resp_a", "key-a")).lease_until == NOW + 60
    assert sorted(await store.expire(NOW + 61, abandon)) == ["resp_a", "resp_b"]


async def test_purge_deletes_the_finished_responses_made_before_a_time(store):
    for i, status in enumerate(("completed", "failed", "cancelled", "incomplete", "in_progress")):
        stored = make_response(f"resp_old{i}", status=status)
        await store.create(replace(stored, created_at=NOW - 100))
    await store.create(replace(make_response("resp_new"), created_at=NOW))
    assert await store.purge(NOW - 50) == 4
    for i in range(4):
        assert await store.get(f"resp_old{i}", "key-a") is None
    assert await store.get("resp_old4", "key-a") is not None  # still running: expire ends it first
    assert await store.get("resp_new", "key-a") is not None
    assert await store.purge(NOW - 50) == 0


async def test_purge_goes_past_a_batch():
    store = open_response_store("memory")
    try:
        for i in range(1203):
            await store.create(replace(make_response(f"resp_{i}"), created_at=NOW - 100))
        assert await store.purge(NOW) == 1203
        assert await store.get("resp_7", "key-a") is None
    finally:
        await store.close()


async def test_a_database_made_before_leases_gains_the_column(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # the table as the previous release made it, with a row
        conn.execute("CREATE TABLE stored_responses (id TEXT PRIMARY KEY, key_id TEXT NOT NULL, created_at REAL "
                     "NOT NULL, status TEXT NOT NULL, model TEXT NOT NULL, previous_response_id TEXT, instructions "
                     "TEXT, input_items TEXT NOT NULL, response TEXT NOT NULL, metadata TEXT NOT NULL)")
        conn.execute("INSERT INTO stored_responses VALUES ('resp_stuck', 'key-a', 1, 'in_progress', 'm1', NULL, "
                     "NULL, '[]', '{\"id\": \"resp_stuck\", \"status\": \"in_progress\"}', '{}')")
    store = open_response_store(f"sqlite://{path}")
    try:
        assert await store.expire(NOW, abandon) == ("resp_stuck",)
        stuck = await store.get("resp_stuck", "key-a")
        assert stuck.status == "failed" and stuck.lease_until is None
    finally:
        await store.close()


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("45s", 45),
                                           ("3600", 3600), (7200, 7200), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert parse_duration(text, "ttl") == seconds


@pytest.mark.parametrize("text", ["0", "-5", "forever", "3w", "", True])
def test_a_duration_that_is_not_one_names_its_field(text):
    with pytest.raises(ValueError, match="^ttl: "):
        parse_duration(text, "ttl")
