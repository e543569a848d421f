"""The space a batch's lines and files take comes back once they are deleted (SQLite: the file is
auto_vacuum = INCREMENTAL and purge_files reclaims; sqlite_backend.py), on a new file and on
one made before without auto_vacuum."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from tokenway.batches import StoredFile, open_batch_store
from tokenway.batches import sqlite_backend as sqlite_backend_module

from .conftest import NOW, make_batch

pytestmark = pytest.mark.anyio


def dir_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file())


def auto_vacuum(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA auto_vacuum").fetchone()[0]


async def test_a_deleted_batch_and_file_give_their_space_back(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    store = open_batch_store(f"sqlite://{data}/ledger.db")
    try:
        kept = await make_batch(store, 1000)  # what the file holds beside: kept throughout
        await store.purge_files(NOW)
        before = dir_bytes(data)
        big = await make_batch(store, 30_000, now=NOW + 1)
        content = b'{"custom_id": "x"}\n' * 300_000  # 5.7 MB
        file = StoredFile("file-" + "b" * 24, "key-a", "batch", "big.jsonl", len(content), NOW, None)
        await store.create_file(file, content)
        grown = dir_bytes(data)
        assert grown > before + 10_000_000  # the lines and the file are there (and the WAL that wrote them)
        await store.cancel_batch(big.id, "key-a")  # ends at once: no line was running; its error file is made
        assert await store.delete_batch(big.id, "key-a") and await store.delete_file(file.id, "key-a")
        await store.purge_files(NOW)
        after = dir_bytes(data)
        assert after <= 1.1 * before, (before, grown, after)
        assert (await store.get_batch(kept.id, "key-a")).counts.total == 1000
    finally:
        await store.close()
    assert auto_vacuum(data / "ledger.db") == sqlite_backend_module.INCREMENTAL


def database_made_before(path: Path) -> None:
    """A ledger's file as a server made it before: WAL, tables (and a row), no auto_vacuum."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE usage (request_id TEXT PRIMARY KEY, cost REAL)")
        conn.execute("INSERT INTO usage VALUES ('r1', 0.5)")
    assert auto_vacuum(path) == 0


async def test_a_small_file_made_without_auto_vacuum_is_switched_once(tmp_path):
    path = tmp_path / "ledger.db"
    database_made_before(path)
    ledger = sqlite3.connect(path)  # another store's connection, open meanwhile (as the ledger's is)
    store = open_batch_store(f"sqlite://{path}")
    try:
        batch = await make_batch(store, 10)
        assert auto_vacuum(path) == sqlite_backend_module.INCREMENTAL
        assert ledger.execute("SELECT cost FROM usage").fetchall() == [(0.5,)]  # kept, and readable
        assert (await store.get_batch(batch.id, "key-a")).counts.total == 10
    finally:
        await store.close()
        ledger.close()


async def test_a_large_file_made_without_auto_vacuum_is_left_with_a_warning(tmp_path, monkeypatch, caplog):
    path = tmp_path / "ledger.db"
    database_made_before(path)
    monkeypatch.setattr(sqlite_backend_module, "SWITCH_BY_VACUUM_BYTES", 0)  # every file is "large"
    store = open_batch_store(f"sqlite://{path}")
    try:
        with caplog.at_level(logging.WARNING, logger=sqlite_backend_module.__name__):
            batch = await make_batch(store, 10)
        assert auto_vacuum(path) == 0
        assert any("auto_vacuum = INCREMENTAL; VACUUM" in record.getMessage() for record in caplog.records)
        await store.cancel_batch(batch.id, "key-a")
        assert await store.delete_batch(batch.id, "key-a")
        await store.purge_files(NOW)  # nothing to give back on such a file; no error either
    finally:
        await store.close()
