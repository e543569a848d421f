"""A database that is down: a call is refused with a 503 and Retry-After, those after it at once
(without waiting on the database) until the retry time, and the first after that tries again;
a connection the database dropped is replaced without the caller seeing it. And the bounds of
the in-memory store, which has no database to fill."""

import logging
import socket
import sqlite3

import anyio
import pytest

import tokenway.conversations.database as database
from tokenway.conversations import ResponseStoreUnavailable, open_response_store
from tokenway.conversations.backend import dumps, row_values
from tokenway.protocol.errors import openai_error_body

from .conftest import make_response, render

pytestmark = pytest.mark.anyio


def count_sqlite_connects(monkeypatch) -> list[str]:
    paths = []
    real_connect = sqlite3.connect

    def connect(path, *args, **kwargs):
        paths.append(path)
        return real_connect(path, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    return paths


async def test_a_database_down_is_a_503_with_retry_after_and_later_calls_are_refused_at_once(
        tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=database.__name__)
    monkeypatch.setattr(database, "RETRY_FIRST_S", 60.0)
    connects = count_sqlite_connects(monkeypatch)
    store = open_response_store(f"sqlite://{tmp_path}/missing-dir/responses.db")  # cannot be opened
    try:
        with pytest.raises(ResponseStoreUnavailable) as caught:
            await store.get("resp_1", "key-a")
        assert (caught.value.status, caught.value.headers["retry-after"]) == (503, "60")
        assert openai_error_body(caught.value) == {"error": {
            "message": "Stored responses cannot be read or written now: their database is unreachable.",
            "type": "service_unavailable", "param": None, "code": "response_store_unavailable"}}
        assert len(connects) == 1  # a new connection that failed is not tried twice
        calls = [lambda: store.get("resp_1", "key-a"), lambda: store.create(make_response("resp_1")),
                 lambda: store.chain("resp_1", "key-a"), lambda: store.input_items("resp_1", "key-a")]
        for call in calls:
            with pytest.raises(ResponseStoreUnavailable) as caught:
                await call()
            assert 1 <= int(caught.value.headers["retry-after"]) <= 60
        assert len(connects) == 1
        assert [r.levelname for r in caplog.records] == ["WARNING"]  # one line as the outage starts
    finally:
        await store.close()


async def test_the_first_call_after_the_retry_time_tries_again_and_ends_the_outage(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=database.__name__)
    monkeypatch.setattr(database, "RETRY_FIRST_S", 0.0)
    directory = tmp_path / "later"
    store = open_response_store(f"sqlite://{directory}/responses.db")
    try:
        for _ in range(2):
            with pytest.raises(ResponseStoreUnavailable):
                await store.create(make_response("resp_1"))
        directory.mkdir()
        await store.create(make_response("resp_1"))
        assert (await store.get("resp_1", "key-a")).id == "resp_1"
        assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
        assert "reachable again" in caplog.records[-1].getMessage()
    finally:
        await store.close()


async def test_a_postgresql_nobody_listens_on_is_a_503():
    pytest.importorskip("psycopg", reason="the PostgreSQL backend needs psycopg 3")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_response_store(f"postgresql://postgres@127.0.0.1:{port}/tokenway")
    try:
        with pytest.raises(ResponseStoreUnavailable):
            await store.chain("resp_1", "key-a")
    finally:
        await store.close()


async def test_a_connection_postgresql_dropped_is_replaced_without_the_caller_seeing_it(postgres_database):
    import psycopg

    store = open_response_store(postgres_database, num_connections=1)
    try:
        await store.create(make_response("resp_1"))
        with psycopg.connect(postgres_database, autocommit=True) as admin:
            killed = admin.execute("SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                                   " WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()
        assert killed == [(True,)]
        assert (await store.get("resp_1", "key-a")).id == "resp_1"
    finally:
        await store.close()


def test_a_bad_url_is_refused_when_the_store_is_opened():
    for url, message in [("mysql://db", "expected sqlite"), ("sqlite://", "absolute"),
                         ("sqlite:///:memory:", "or 'memory'"), ("postgresql://h/db?nosuchoption=1", "nosuchoption")]:
        with pytest.raises(ValueError, match=message):
            open_response_store(url)
    with pytest.raises(ValueError, match="num_connections"):
        open_response_store("memory", num_connections=0)


async def test_a_closed_store_refuses_calls():
    store = open_response_store("memory")
    await store.close()
    await store.close()
    with pytest.raises(RuntimeError, match="closed"):
        await store.get("resp_1", "key-a")


async def test_the_memory_store_keeps_the_newest_responses_within_its_budget():
    row = row_values(make_response("resp_0", status="in_progress"), dumps)
    size = sum(len(value) for value in row if isinstance(value, str))
    store = open_response_store("memory", memory_max_bytes=3 * size + size // 2)
    try:
        for i in range(6):
            await store.create(make_response(f"resp_{i}", status="in_progress"))
        kept = [i for i in range(6) if await store.get(f"resp_{i}", "key-a") is not None]
        assert kept == [3, 4, 5]
        # A response that grows past the budget by itself stays (the newest always does)...
        huge = render("resp_5", "completed", "x" * 4 * size)
        assert await store.update("resp_5", status="completed", response=huge)
        assert [i for i in range(6) if await store.get(f"resp_{i}", "key-a") is not None] == [5]
        # ...until a newer one comes.
        await store.create(make_response("resp_6"))
        assert await store.get("resp_5", "key-a") is None
        assert await store.get("resp_6", "key-a") is not None
        assert await store.delete("resp_6", "key-a")
    finally:
        await store.close()


async def test_keep_rides_out_an_outage_and_reads_meanwhile_are_refused_not_stalled(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(database, "RETRY_MAX_S", 0.05)
    directory = tmp_path / "later"
    store = open_response_store(f"sqlite://{directory}/responses.db")
    try:
        store.keep(make_response("resp_1"))
        with pytest.raises(ResponseStoreUnavailable):  # waits for the insert's first try only
            await store.get("resp_1", "key-a")
        directory.mkdir()  # the database comes back: the insert's next try lands
        for _ in range(100):
            try:
                if await store.get("resp_1", "key-a") is not None:
                    break
            except ResponseStoreUnavailable:
                pass
            await anyio.sleep(0.02)
        assert (await store.get("resp_1", "key-a")).response == render("resp_1", "completed", "an answer to hello")
    finally:
        await store.close()


async def test_keep_gives_up_after_its_patience_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(database, "RETRY_FIRST_S", 0.02)
    monkeypatch.setattr(database, "RETRY_MAX_S", 0.02)
    monkeypatch.setattr(database, "KEEP_PATIENCE_S", 0.1)
    store = open_response_store(f"sqlite://{tmp_path}/missing-dir/responses.db")
    try:
        store.keep(make_response("resp_1"))
        await anyio.sleep(0.5)
        assert any("resp_1 is not stored" in record.getMessage() and record.levelname == "ERROR"
                   for record in caplog.records)
    finally:
        await store.close()
