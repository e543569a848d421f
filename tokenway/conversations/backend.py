"""What a response store's backend is (ResponseBackend: one connection, used by one thread at a
time), the SQL its two dialects share, and which failures are the database's rather than a bug's.
The backends: sqlite_backend.py (also the in-memory store) and postgres_backend.py.

One table, stored_responses, a row per response, its payloads (input_items, response,
metadata) as JSON text in SQLite and JSONB in PostgreSQL. The API's queries find rows by id,
the primary key, and nothing else: get, update, delete, input_items, and each step of chain's
walk from a response to the one it continues. So the key needs no index of its own: it is
checked on the row the id found. The upkeep's two scans have an index each: purge's by
created_at, expire's by lease_until over the rows still running only (a partial index: the
finished ones, nearly all, are not in it).

A running response's lease renewal writes its usage so far too (prompt_tokens, cached_tokens,
completion_tokens), one statement a response: what the server that fails it, once its own
server stopped, bills it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, LiteralString, Protocol, cast

from tokenway.conversations.store import (
    FINAL_STATUSES,
    RUNNING_STATUSES,
    STATUSES,
    JSONObject,
    ResponseStatus,
    ResponseUsage,
    StoredResponse,
    Turn,
)

COLUMNS: tuple[LiteralString, ...] = ("id", "key_id", "created_at", "status", "model", "previous_response_id",
                                      "instructions", "input_items", "response", "metadata", "lease_until",
                                      "prompt_tokens", "cached_tokens", "completion_tokens")
assert tuple(field.name for field in dataclasses.fields(StoredResponse)) == COLUMNS
JSON_COLUMNS = frozenset({"input_items", "response", "metadata"})
# The usage columns, added since the first schema: a table made before them gains them (each
# backend's migration), its rows at 0.
USAGE_COLUMNS: tuple[LiteralString, ...] = ("prompt_tokens", "cached_tokens", "completion_tokens")
USAGE_DEFINITION: LiteralString = "INTEGER NOT NULL DEFAULT 0"


def _status_in(statuses: Iterable[str]) -> LiteralString:
    # Made of the status literals alone (pyright cannot follow a literal through the join).
    return cast(LiteralString, "status IN (" + ", ".join(f"'{status}'" for status in sorted(statuses)) + ")")


STATUS_CHECK = _status_in(STATUSES)
RUNNING = _status_in(RUNNING_STATUSES)
FINAL = _status_in(FINAL_STATUSES)
# The upkeep's indexes (made after the table, and after the migration that adds lease_until).
INDEXES: tuple[LiteralString, ...] = (
    "CREATE INDEX IF NOT EXISTS stored_responses_created_at ON stored_responses (created_at)",
    f"CREATE INDEX IF NOT EXISTS stored_responses_running ON stored_responses (lease_until) WHERE {RUNNING}",
)
PURGE_BATCH = 500  # rows a purge deletes a statement: a write lock (SQLite's is the ledger's too) held briefly


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

    def renew(self, response_id_to_usage: Mapping[str, ResponseUsage], lease_until: float) -> int:
        """The running ones' leases set to lease_until and their usage to what is given, in one
        transaction; how many."""
        ...

    def stale(self, now: float, unleased_before: float) -> list[StoredResponse]:
        """Every response running whose lease has passed, or that has none and was made before
        unleased_before."""
        ...

    def expire(self, response_id: str, response: JSONObject, now: float, unleased_before: float) -> bool:
        """Stored failed (as `response` renders it), if it is still stale (as stale() says)."""
        ...

    def purge(self, created_before: float, limit: int) -> int:
        """Up to `limit` finished responses created before then, deleted; how many."""
        ...

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
     metadata, lease_until, prompt_tokens, cached_tokens, completion_tokens) = row
    return StoredResponse(response_id, key_id, created_at, cast(ResponseStatus, status), model, previous_response_id,
                          instructions, tuple(decode(input_items)), decode(response), decode(metadata), lease_until,
                          prompt_tokens, cached_tokens, completion_tokens)


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


def renew_sql(mark: LiteralString) -> LiteralString:
    """Parameters: renew_params' (a response's own usage: one statement each, run as a batch)."""
    return (f"UPDATE stored_responses SET lease_until = {mark}, prompt_tokens = {mark}, cached_tokens = {mark},"
            f" completion_tokens = {mark} WHERE id = {mark} AND {RUNNING}")


def renew_params(response_id_to_usage: Mapping[str, ResponseUsage], lease_until: float) -> list[tuple]:
    return [(lease_until, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, response_id)
            for response_id, usage in response_id_to_usage.items()]


def _stale(mark: LiteralString) -> LiteralString:
    """Parameters: now, unleased_before. A row without a lease was made by a server from before
    leases: one of those may still be running it, for a while."""
    return f"{RUNNING} AND (lease_until < {mark} OR lease_until IS NULL AND created_at < {mark})"


def stale_sql(mark: LiteralString) -> LiteralString:
    return f"SELECT {', '.join(COLUMNS)} FROM stored_responses WHERE {_stale(mark)}"


def expire_sql(mark: LiteralString) -> LiteralString:
    """Parameters: response, id, now, unleased_before. Staleness is checked again here: a
    renewal since stale() read the row keeps it running."""
    return (f"UPDATE stored_responses SET status = 'failed', response = {mark}, lease_until = NULL WHERE id = {mark}"
            f" AND {_stale(mark)}")


def purge_sql(mark: LiteralString) -> LiteralString:
    """Parameters: created_before, limit. A subquery's LIMIT: both dialects take it (SQLite's
    DELETE ... LIMIT is a compile-time option)."""
    return (f"DELETE FROM stored_responses WHERE id IN (SELECT id FROM stored_responses WHERE created_at < {mark}"
            f" AND {FINAL} LIMIT {mark})")

