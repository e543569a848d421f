"""The batch store's PostgreSQL dialect (psycopg 3): the same tables, shared by every gateway
process that uses the database; claims skip the lines another gateway is claiming."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString, cast

import psycopg
from psycopg.conninfo import conninfo_to_dict

from tokenway.batches import schema
from tokenway.batches.backend import BatchBackend, Cursor
from tokenway.sql import pg_timeouts

# Any constant (not the ledger's nor the response store's): serializes CREATE TABLE IF NOT
# EXISTS between gateways starting together (concurrent creates of one table can fail on the
# catalog's unique index).
_SCHEMA_LOCK_ID = 0x7BA7_C0DE
_SCHEMA = schema.schema("DOUBLE PRECISION", "BYTEA")


def connect_kwargs(url: str) -> dict[str, Any]:
    """libpq's timeouts, unless the url sets them (a database host that vanished must give a
    prompt error to answer 503 with, not hold a query for minutes). ValueError for a url libpq
    cannot parse."""
    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"batch store url: {exc}") from None
    return {"autocommit": True, **pg_timeouts(given)}


def _text(value: Any) -> Any:
    # PostgreSQL's TEXT cannot hold U+0000 (JSON text has it escaped; a custom_id or a filename may not).
    return value.replace("\x00", "\ufffd") if isinstance(value, str) and "\x00" in value else value


class PostgresBatchBackend(BatchBackend):
    LOCK_LINES = " FOR UPDATE SKIP LOCKED"
    LOCK_BATCH = " FOR UPDATE"

    def __init__(self, url: str, kwargs: dict[str, Any]) -> None:
        """kwargs: connect_kwargs(url). autocommit: each statement commits on its own, unless in transaction()."""
        self._conn = psycopg.connect(url, **kwargs)
        self._sql: dict[str, LiteralString] = {}  # a query with "?" marks -> with psycopg's
        try:
            with self._conn.transaction():
                self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_ID,))
                for statement in _SCHEMA:
                    self._conn.execute(statement)
                # Only what is missing: ALTER TABLE locks the table whole even when the column is
                # there, and a gateway opening a connection beside another one's transactions
                # deadlocked on it.
                columns = {row[0] for row in self._conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
                    " AND table_name = 'batches'")}
                for name, kind in schema.added_columns("DOUBLE PRECISION"):
                    if name not in columns:
                        self._conn.execute(f"ALTER TABLE batches ADD COLUMN {name} {kind}")
                if self._conn.execute("SELECT to_regclass('batches_forwarded')").fetchone() == (None,):
                    self._conn.execute(schema.FORWARDED_INDEX)
        except BaseException:
            self._conn.close()
            raise

    def _marked(self, sql: LiteralString) -> LiteralString:
        marked = self._sql.get(sql)
        if marked is None:
            # The queries hold no "?" or "%" but their marks (values are always parameters).
            marked = self._sql[sql] = cast(LiteralString, sql.replace("?", "%s"))
        return marked

    def execute(self, sql: LiteralString, params: Sequence[Any] = ()) -> Cursor:
        return self._conn.execute(self._marked(sql), [_text(value) for value in params])

    def executemany(self, sql: LiteralString, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(self._marked(sql), [[_text(value) for value in row] for row in rows])

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._conn.transaction():
            yield

    def close(self) -> None:
        self._conn.close()
