"""The response store's PostgreSQL backend (psycopg 3): the same table and semantics as
SqliteBackend, payloads in JSONB, shared by every gateway process that uses the database.

Two things JSONB and TEXT cannot hold, and what is kept instead: U+0000 (in any string: a
user's input may carry it) becomes U+FFFD, the replacement character; and JSONB keeps an
object's keys in its own order (shorter keys first), not the order they were written in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, LiteralString

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from tokenway.conversations.backend import (
    COLUMNS,
    INDEXES,
    STATUS_CHECK,
    USAGE_COLUMNS,
    USAGE_DEFINITION,
    chain_sql,
    delete_sql,
    dumps,
    expire_sql,
    from_row,
    insert_sql,
    purge_sql,
    renew_params,
    renew_sql,
    row_values,
    select_sql,
    stale_sql,
    turn_from_row,
    update_sql,
)
from tokenway.conversations.store import JSONObject, ResponseStatus, ResponseUsage, StoredResponse, Turn
from tokenway.sql import pg_timeouts

# Any constant (not the ledger's): serializes CREATE TABLE IF NOT EXISTS between gateways starting
# together (concurrent creates of one table can fail on the catalog's unique index).
_SCHEMA_LOCK_ID = 0x70C3_C0DE
_SCHEMA: LiteralString = f"""
CREATE TABLE IF NOT EXISTS stored_responses (
    id TEXT PRIMARY KEY, key_id TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL CHECK ({STATUS_CHECK}), model TEXT NOT NULL, previous_response_id TEXT,
    instructions TEXT, input_items JSONB NOT NULL, response JSONB NOT NULL, metadata JSONB NOT NULL,
    lease_until DOUBLE PRECISION, prompt_tokens {USAGE_DEFINITION}, cached_tokens {USAGE_DEFINITION},
    completion_tokens {USAGE_DEFINITION});
"""
# A table made before lease_until, or the usage columns, existed gains them.
_MIGRATIONS: tuple[LiteralString, ...] = (
    "ALTER TABLE stored_responses ADD COLUMN IF NOT EXISTS lease_until DOUBLE PRECISION",
    *(f"ALTER TABLE stored_responses ADD COLUMN IF NOT EXISTS {column} {USAGE_DEFINITION}"
      for column in USAGE_COLUMNS), *INDEXES)
_INSERT = insert_sql("%s")
_SELECT = select_sql(", ".join(COLUMNS), "%s")
_SELECT_INPUT_ITEMS = select_sql("input_items", "%s")
_DELETE = delete_sql("%s")
_CHAIN = chain_sql("%s", "COALESCE(r.response -> 'output', '[]'::jsonb)")
_STALE = stale_sql("%s")
_RENEW = renew_sql("%s")
_EXPIRE = expire_sql("%s")
_PURGE = purge_sql("%s")
# \u0000 in JSON text, as an escape (an even run of backslashes before it, none at all included),
# not as the text "\\u0000" a string may hold.
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def connect_kwargs(url: str) -> dict[str, Any]:
    """libpq's timeouts, unless the url sets them: without them a database host that vanished
    (no RST, as in a network partition) holds a query for minutes, where the store wants a prompt
    error to answer 503 with. Raises ValueError for a url libpq cannot parse."""
    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"response store url: {exc}") from None
    return {"autocommit": True, **pg_timeouts(given)}


def _jsonb_dumps(value: Any) -> str:
    text = dumps(value)
    return _NUL_ESCAPE.sub(r"\1\\ufffd", text) if "\\u0000" in text else text


def _decoded(value: Any) -> Any:
    return value  # psycopg decodes jsonb itself


def _text(value: str | None) -> str | None:
    return value.replace("\x00", "\ufffd") if value is not None and "\x00" in value else value


class PostgresBackend:
    def __init__(self, url: str, kwargs: dict[str, Any]) -> None:
        """kwargs: connect_kwargs(url). autocommit: each statement commits on its own."""
        self._conn = psycopg.connect(url, **kwargs)
        try:
            with self._conn.transaction():
                self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_ID,))
                self._conn.execute(_SCHEMA)
                for statement in _MIGRATIONS:
                    self._conn.execute(statement)
        except BaseException:
            self._conn.close()
            raise

    def insert(self, response: StoredResponse) -> None:
        values = row_values(response, lambda value: Jsonb(value, _jsonb_dumps))
        self._conn.execute(_INSERT, tuple(_text(value) if isinstance(value, str) else value for value in values))

    def update(self, response_id: str, status: ResponseStatus, response: JSONObject,
               from_statuses: tuple[ResponseStatus, ...]) -> bool:
        cur = self._conn.execute(update_sql("%s", len(from_statuses)),
                                 (status, Jsonb(response, _jsonb_dumps), response_id, *from_statuses))
        return cur.rowcount == 1

    def get(self, response_id: str, key_id: str) -> StoredResponse | None:
        row = self._conn.execute(_SELECT, (response_id, key_id)).fetchone()
        return None if row is None else from_row(row, _decoded)

    def delete(self, response_id: str, key_id: str) -> bool:
        return self._conn.execute(_DELETE, (response_id, key_id)).rowcount == 1

    def chain(self, response_id: str, key_id: str, max_depth: int) -> list[Turn]:
        rows = self._conn.execute(_CHAIN, (response_id, key_id, key_id, max_depth)).fetchall()
        return [turn_from_row(row, _decoded) for row in rows]

    def input_items(self, response_id: str, key_id: str) -> tuple[JSONObject, ...] | None:
        row = self._conn.execute(_SELECT_INPUT_ITEMS, (response_id, key_id)).fetchone()
        return None if row is None else tuple(row[0])

    def renew(self, response_id_to_usage: Mapping[str, ResponseUsage], lease_until: float) -> int:
        # One transaction, its statements pipelined (psycopg's executemany): one round trip.
        with self._conn.transaction(), self._conn.cursor() as cur:
            cur.executemany(_RENEW, renew_params(response_id_to_usage, lease_until))
            return cur.rowcount

    def stale(self, now: float, unleased_before: float) -> list[StoredResponse]:
        return [from_row(row, _decoded) for row in self._conn.execute(_STALE, (now, unleased_before)).fetchall()]

    def expire(self, response_id: str, response: JSONObject, now: float, unleased_before: float) -> bool:
        return self._conn.execute(_EXPIRE, (Jsonb(response, _jsonb_dumps), response_id, now,
                                            unleased_before)).rowcount == 1

    def purge(self, created_before: float, limit: int) -> int:
        return self._conn.execute(_PURGE, (created_before, limit)).rowcount

    def close(self) -> None:
        self._conn.close()
