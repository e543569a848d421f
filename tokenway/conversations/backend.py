"""What a response store's backend is (ResponseBackend: one connection, used by one thread at a
time), the SQL its two dialects share, and which failures are the database's rather than a bug's.
The backends: sqlite_backend.py (also the in-memory store) and postgres_backend.py.

One table, stored_responses, a row per response, its payloads (input_items, response,
metadata) as JSON text in SQLite and JSONB in PostgreSQL. Every query finds rows by id, the
primary key, and nothing else: get, update, delete, input_items, and each step of chain's walk
from a response to the one it continues. So the key needs no index of its own: it is checked on
the row the id found.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, LiteralString, Protocol, cast

from tokenway.conversations.store import STATUSES, JSONObject, ResponseStatus, StoredResponse, Turn

COLUMNS: tuple[LiteralString, ...] = ("id", "key_id", "created_at", "status", "model", "previous_response_id",
                                      "instructions", "input_items", "response", "metadata")
assert tuple(field.name for field in dataclasses.fields(StoredResponse)) == COLUMNS
JSON_COLUMNS = frozenset({"input_items", "response", "metadata"})

# Made of STATUSES' literals alone (pyright cannot follow a literal through the join).
STATUS_CHECK = cast(LiteralString, "status IN (" + ", ".join(f"'{status}'" for status in STATUSES) + ")")


class ResponseBackend(Protocol):
    """One connection to one database. The store's checks (of a chain's links, of a page) are
    the caller's: a backend answers what the rows hold."""

    def insert(self, response: StoredResponse) -> None:
        """A no-op when the id is there already: a retry of an insert that did commit."""
        ...

    def update(self, response_id: str, status: ResponseStatus, response: JSONObject,
               from_statuses: tuple[ResponseStatus, ...]) -> bool:
        """Only while the stored status is one of from_statuses; True when it wrote."""
        ...

    def get(self, response_id: str, key_id: str) -> StoredResponse | None: ...

    def delete(self, response_id: str, key_id: str) -> bool: ...

    def chain(self, response_id: str, key_id: str, max_depth: int) -> list[Turn]:
        """In one statement: the response and those it continues, the key's only, up to max_depth
        links back (max_depth + 1 turns), oldest first."""
        ...

    def input_items(self, response_id: str, key_id: str) -> tuple[JSONObject, ...] | None: ...

    def close(self) -> None: ...


def dumps(value: Any) -> str:
    # allow_nan=False: NaN is not JSON, and PostgreSQL's jsonb refuses it; SQLite must not keep
    # what PostgreSQL would not.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def row_values(response: StoredResponse, encode: Callable[[Any], Any]) -> tuple:
    """The row of COLUMNS, each JSON column through `encode`."""
    return tuple(encode(getattr(response, column)) if column in JSON_COLUMNS else getattr(response, column)
                 for column in COLUMNS)


def from_row(row: Sequence[Any], decode: Callable[[Any], Any]) -> StoredResponse:
    (response_id, key_id, created_at, status, model, previous_response_id, instructions, input_items, response,
     metadata) = row
    return StoredResponse(response_id, key_id, created_at, cast(ResponseStatus, status), model, previous_response_id,
                          instructions, tuple(decode(input_items)), decode(response), decode(metadata))


def turn_from_row(row: Sequence[Any], decode: Callable[[Any], Any]) -> Turn:
    response_id, previous_response_id, status, model, input_items, output = row
    return Turn(response_id, previous_response_id, cast(ResponseStatus, status), model, tuple(decode(input_items)),
                tuple(decode(output)))


def insert_sql(mark: LiteralString) -> LiteralString:
    return (f"INSERT INTO stored_responses ({', '.join(COLUMNS)}) VALUES ({', '.join(mark for _ in COLUMNS)})"
            " ON CONFLICT (id) DO NOTHING")


def update_sql(mark: LiteralString, num_from_statuses: int) -> LiteralString:
    # Conditional: a cancel that landed first (a final status) is never overwritten by the
    # runner's later write, whichever gateway process each came through.
    return (f"UPDATE stored_responses SET status = {mark}, response = {mark} WHERE id = {mark}"
            f" AND status IN ({', '.join(mark for _ in range(num_from_statuses))})")


def select_sql(columns: LiteralString, mark: LiteralString) -> LiteralString:
    return f"SELECT {columns} FROM stored_responses WHERE id = {mark} AND key_id = {mark}"


def delete_sql(mark: LiteralString) -> LiteralString:
    return f"DELETE FROM stored_responses WHERE id = {mark} AND key_id = {mark}"


def chain_sql(mark: LiteralString, output: LiteralString) -> LiteralString:
    """Parameters: response_id, key_id, key_id, max_depth. `output`: the dialect's expression for
    the "output" array of the response row `r`. The walk stops at a link that is missing or
    another key's (the oldest row returned then still names a previous_response_id) and after
    max_depth links; each row it visits is one primary-key lookup."""
    return (
        "WITH RECURSIVE conversation (id, previous_response_id, status, model, input_items, output, depth) AS ("
        f" SELECT r.id, r.previous_response_id, r.status, r.model, r.input_items, {output}, 0"
        f" FROM stored_responses AS r WHERE r.id = {mark} AND r.key_id = {mark}"
        " UNION ALL"
        f" SELECT r.id, r.previous_response_id, r.status, r.model, r.input_items, {output}, conversation.depth + 1"
        " FROM stored_responses AS r JOIN conversation ON r.id = conversation.previous_response_id"
        f" WHERE r.key_id = {mark} AND conversation.depth < {mark})"
        " SELECT id, previous_response_id, status, model, input_items, output FROM conversation ORDER BY depth DESC")


def close_quietly(backend: ResponseBackend | None) -> None:
    if backend is not None:
        try:
            backend.close()
        except Exception:  # already failing, or closing at shutdown: the connection is dropped either way
            pass
