"""The response store's upkeep on every backend (SQLite, in memory, a real PostgreSQL): leases
of running responses are renewed, a running response whose lease passed is stored failed once
(and one renewed in time is not), purge deletes the finished responses made before a time and
keeps the running ones; a database made before leases existed gains the column."""

import sqlite3
from dataclasses import replace

import pytest

from tokenway.conversations import ResponseUsage, open_response_store, parse_duration

from .conftest import make_response, render

pytestmark = pytest.mark.anyio

NOW = 1_750_000_100.0
NOTHING = ResponseUsage()


def abandon(response):
    return {**response, "status": "failed", "error": {"code": "server_error", "message": "gone"}}


async def test_a_running_response_whose_lease_passed_is_failed_once(store):
    await store.create(replace(make_response("resp_held", status="in_progress"), lease_until=NOW + 30))
    await store.create(replace(make_response("resp_gone", status="in_progress"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_queued", status="queued"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_old", status="in_progress"), created_at=NOW - 3601))  # no lease
    await store.create(make_response("resp_unleased", status="in_progress"))  # ... and may still run: made just now
    await store.create(replace(make_response("resp_done"), lease_until=NOW - 1))  # finished: not running
    assert sorted(stored.id for stored in await store.expire(NOW, abandon)) == ["resp_gone", "resp_old",
                                                                               "resp_queued"]
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
    assert await store.renew(dict.fromkeys(("resp_a", "resp_b", "resp_c", "resp_missing"), NOTHING),
                             NOW + 60) == 2  # the running ones
    assert await store.renew({}, NOW + 60) == 0
    assert await store.expire(NOW, abandon) == ()
    assert (await store.get("resp_a", "key-a")).lease_until == NOW + 60
    assert sorted(stored.id for stored in await store.expire(NOW + 61, abandon)) == ["resp_a", "resp_b"]


async def test_each_renewal_keeps_a_running_responses_usage_and_expire_hands_it_on(store):
    await store.create(replace(make_response("resp_a", status="in_progress"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_b", status="queued"), lease_until=NOW - 1))
    await store.create(replace(make_response("resp_done"), lease_until=NOW - 1))
    assert await store.renew({"resp_a": ResponseUsage(40, 8, 3), "resp_b": NOTHING}, NOW + 10) == 2
    assert (await store.get("resp_a", "key-a")).usage == ResponseUsage(40, 8, 3)
    # Later renewals overwrite it with the newer counts; a finished response's is left alone.
    assert await store.renew({"resp_a": ResponseUsage(40, 8, 250), "resp_b": ResponseUsage(12, 0, 1),
                              "resp_done": ResponseUsage(1, 1, 1)}, NOW + 20) == 2
    assert (await store.get("resp_done", "key-a")).usage == NOTHING
    expired = {stored.id: stored for stored in await store.expire(NOW + 21, abandon)}
    assert sorted(expired) == ["resp_a", "resp_b"]
    assert expired["resp_a"].usage == ResponseUsage(40, 8, 250) and expired["resp_b"].usage == ResponseUsage(12, 0, 1)
    assert expired["resp_a"].status == expired["resp_a"].response["status"] == "failed"
    assert (expired["resp_a"].key_id, expired["resp_a"].model, expired["resp_a"].lease_until) == ("key-a", "m1", None)
    stored = await store.get("resp_a", "key-a")  # as expire said it stored it
    assert stored == expired["resp_a"]


async def test_renewals_past_a_batch_keep_every_responses_usage(store):
    for i in range(1203):
        await store.create(replace(make_response(f"resp_{i}", status="in_progress"), lease_until=NOW - 1))
    assert await store.renew({f"resp_{i}": ResponseUsage(i, 0, i + 1) for i in range(1203)}, NOW + 60) == 1203
    assert (await store.get("resp_1202", "key-a")).usage == ResponseUsage(1202, 0, 1203)
    assert await store.expire(NOW, abandon) == ()


@pytest.mark.parametrize("counts", [(-1, 0, 0), (0, 0, -1), (3, 4, 0)])
def test_a_usage_that_cannot_be_is_refused(counts):
    with pytest.raises(ValueError):
        ResponseUsage(*counts)


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
        (expired,) = await store.expire(NOW, abandon)
        assert expired.id == "resp_stuck" and expired.usage == NOTHING  # the usage columns added, at 0
        stuck = await store.get("resp_stuck", "key-a")
        assert stuck.status == "failed" and stuck.lease_until is None
    finally:
        await store.close()


async def test_a_table_made_before_usage_was_kept_gains_its_columns(store_url, tmp_path):
    """The previous release's table (leases, no usage), on SQLite and PostgreSQL, with a running
    response: opened by this one, its renewals keep usage."""
    if store_url == "memory":
        pytest.skip("an in-memory store starts empty: there is no table from before")
    text, real = ("TEXT", "REAL") if store_url.startswith("sqlite://") else ("JSONB", "DOUBLE PRECISION")
    old_table = (f"CREATE TABLE stored_responses (id TEXT PRIMARY KEY, key_id TEXT NOT NULL, created_at {real} NOT "
                 "NULL, status TEXT NOT NULL, model TEXT NOT NULL, previous_response_id TEXT, instructions TEXT, "
                 f"input_items {text} NOT NULL, response {text} NOT NULL, metadata {text} NOT NULL, "
                 f"lease_until {real})")
    row = ("INSERT INTO stored_responses VALUES ('resp_running', 'key-a', 1, 'in_progress', 'm1', NULL, NULL, "
           "'[]', '{\"id\": \"resp_running\", \"status\": \"in_progress\"}', '{}', 5)")
    if store_url.startswith("sqlite://"):
        with sqlite3.connect(store_url.removeprefix("sqlite://")) as conn:
            conn.execute(old_table)
            conn.execute(row)
    else:
        import psycopg

        with psycopg.connect(store_url, autocommit=True) as conn:
            conn.execute(old_table)
            conn.execute(row)
    store = open_response_store(store_url)
    try:
        assert (await store.get("resp_running", "key-a")).usage == NOTHING
        assert await store.renew({"resp_running": ResponseUsage(9, 0, 4)}, NOW) == 1
        (expired,) = await store.expire(NOW + 1, abandon)
        assert expired.usage == ResponseUsage(9, 0, 4)
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
