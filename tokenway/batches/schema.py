"""The batch store's tables, the SQL its two dialects share (BatchBackend, backend.py, runs it;
sqlite_backend.py and postgres_backend.py are the dialects) and the rows' codecs. Queries are
written with "?" marks; PostgreSQL's backend swaps them for its own.

    files        (id) ─ content in the row (BLOB / bytea): every gateway sharing the database serves it
    batches      (id) ─ the status and each status's time; output_file_id, error_file_id once final
    batch_lines  (batch_id, line_index) ─ pending ─► claimed (claimed_by, claim_until) ─► done (outcome ...)

JSON (bodies, answers, metadata) is kept as text in both: never queried inside, and text keeps
an answer's keys in the order it was written (JSONB would not). A batch's counts are its lines'
(a GROUP BY over its primary-key range), never a second copy kept beside them. The lines not
done are in a partial index: the runners' claims, finalize's "all done?" and expiry read only it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, LiteralString, cast

from tokenway.batches.store import (
    BATCH_STATUSES,
    FILE_PURPOSES,
    OUTCOMES,
    STATUS_TIME_FIELDS,
    Batch,
    BatchApi,
    BatchCounts,
    BatchLine,
    BatchStatus,
    FilePurpose,
    LineOutcome,
    Outcome,
    StoredFile,
    line_id_of,
)


def _in(values: Iterable[str]) -> LiteralString:
    # Made of the literals alone (pyright cannot follow a literal through the join).
    return cast(LiteralString, "(" + ", ".join(f"'{value}'" for value in sorted(values)) + ")")


def marks(num: int) -> LiteralString:
    return cast(LiteralString, ", ".join("?" for _ in range(num)))


# real, blob: the dialect's column types for a unix time and for bytes.
def schema(real: LiteralString, blob: LiteralString) -> tuple[LiteralString, ...]:
    status_times = cast(LiteralString, "".join(f"{name} {real}, " for name in STATUS_TIME_FIELDS))
    return (
        "CREATE TABLE IF NOT EXISTS files ("
        " id TEXT PRIMARY KEY, key_id TEXT NOT NULL,"
        f" purpose TEXT NOT NULL CHECK (purpose IN {_in(FILE_PURPOSES)}), filename TEXT NOT NULL,"
        f" bytes BIGINT NOT NULL, created_at {real} NOT NULL, expires_at {real}, content {blob} NOT NULL)",
        "CREATE INDEX IF NOT EXISTS files_by_key ON files (key_id, created_at)",
        "CREATE INDEX IF NOT EXISTS files_expiring ON files (expires_at) WHERE expires_at IS NOT NULL",
        "CREATE TABLE IF NOT EXISTS batches ("
        " id TEXT PRIMARY KEY, key_id TEXT NOT NULL, api TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT,"
        f" status TEXT NOT NULL CHECK (status IN {_in(BATCH_STATUSES)}),"
        f" created_at {real} NOT NULL, expires_at {real} NOT NULL, {status_times}"
        " metadata TEXT, errors TEXT NOT NULL, output_file_id TEXT, error_file_id TEXT, model TEXT,"
        f" upstream TEXT, upstream_batch_id TEXT, upstream_lease_until {real})",
        "CREATE INDEX IF NOT EXISTS batches_by_key ON batches (key_id, api, created_at)",
        "CREATE INDEX IF NOT EXISTS batches_running ON batches (created_at)"
        " WHERE status IN ('in_progress', 'cancelling')",
        "CREATE INDEX IF NOT EXISTS batches_claimable ON batches (created_at) WHERE status = 'in_progress'",
        "CREATE TABLE IF NOT EXISTS batch_lines ("
        " batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,"
        " state TEXT NOT NULL CHECK (state IN ('pending', 'claimed', 'done')),"
        f" claimed_by TEXT, claim_until {real}, attempts INTEGER NOT NULL DEFAULT 0,"
        f" outcome TEXT CHECK (outcome IN {_in(OUTCOMES)}), status_code INTEGER, request_id TEXT,"
        f" response TEXT, error TEXT, finished_at {real},"
        " PRIMARY KEY (batch_id, line_index))",
        "CREATE INDEX IF NOT EXISTS batch_lines_undone ON batch_lines (batch_id, line_index) WHERE state <> 'done'",
    )


def added_columns(real: LiteralString) -> tuple[tuple[LiteralString, LiteralString], ...]:
    """The batches table's columns added since it was first made, (name, type): a database made
    before gains them (ALTER TABLE, each dialect its own way) after schema()'s statements, and
    then FORWARDED_INDEX."""
    return (("upstream", "TEXT"), ("upstream_batch_id", "TEXT"), ("upstream_lease_until", real))


FORWARDED_INDEX: LiteralString = ("CREATE INDEX IF NOT EXISTS batches_forwarded ON batches (upstream_lease_until)"
                                  " WHERE upstream IS NOT NULL AND status IN ('in_progress', 'cancelling')")

FILE_COLUMNS: LiteralString = "id, key_id, purpose, filename, bytes, created_at, expires_at"
_TIMES: LiteralString = cast(LiteralString, ", ".join(STATUS_TIME_FIELDS))
BATCH_COLUMNS: LiteralString = (f"id, key_id, api, endpoint, input_file_id, status, created_at, expires_at, {_TIMES},"
                                " metadata, errors, output_file_id, error_file_id, model, upstream, upstream_batch_id")
# A line as a runner gets it: its own columns, and its batch's (`l` and `b`).
LINE_COLUMNS: LiteralString = "l.batch_id, l.line_index, l.custom_id, l.body, b.endpoint, b.key_id, b.api"
OUTCOME_COLUMNS: LiteralString = "l.outcome, l.status_code, l.response, l.error, l.request_id"

# ON CONFLICT: a retry of an insert whose commit's reply was lost is a no-op.
INSERT_FILE: LiteralString = (f"INSERT INTO files ({FILE_COLUMNS}, content) VALUES ({marks(8)})"
                              " ON CONFLICT (id) DO NOTHING")
INSERT_BATCH: LiteralString = (f"INSERT INTO batches ({BATCH_COLUMNS}) VALUES ({marks(15 + len(STATUS_TIME_FIELDS))})"
                               " ON CONFLICT (id) DO NOTHING")
INSERT_LINE: LiteralString = ("INSERT INTO batch_lines (batch_id, line_index, custom_id, body, state)"
                              " VALUES (?, ?, ?, ?, 'pending')")
# Parameter: now. The batches whose lines may be claimed, the oldest first, so a batch submitted
# later waits for those before it rather than slowing them all; never a forwarded one's. (The
# index's predicate is this query's own term: SQLite uses a partial index only then.)
CLAIMABLE_BATCHES: LiteralString = ("SELECT id, endpoint, key_id, api FROM batches WHERE status = 'in_progress'"
                                    " AND expires_at > ? AND upstream IS NULL ORDER BY created_at, id")
# Parameters: batch_id, now (claims lapsed before it), limit. Walks the undone lines' index in
# line order and stops at `limit`: a claim costs the lines it takes, not the batch's size.
CLAIMABLE_LINES: LiteralString = (
    "SELECT line_index, custom_id, body, attempts FROM batch_lines WHERE batch_id = ? AND state <> 'done'"
    " AND (state = 'pending' OR claim_until < ?) ORDER BY line_index LIMIT ?")
FINISH: LiteralString = (
    "UPDATE batch_lines SET state = 'done', claim_until = NULL, outcome = ?, status_code = ?, response = ?, error = ?,"
    " request_id = ?, finished_at = ? WHERE batch_id = ? AND line_index = ? AND state = 'claimed' AND claimed_by = ?")
# Parameters: until, batch_id, line_index, worker_id. The claim kept without running the line, and
# the claim that took it not counted (the next claim counts it again).
DEFER: LiteralString = (
    "UPDATE batch_lines SET claim_until = ?, attempts = attempts - 1 WHERE batch_id = ? AND line_index = ?"
    " AND state = 'claimed' AND claimed_by = ?")
# Parameters: outcome, error, finished_at, batch_id, now: the lines no runner holds.
END_IDLE_LINES: LiteralString = (
    "UPDATE batch_lines SET state = 'done', claim_until = NULL, outcome = ?, error = ?, finished_at = ?"
    " WHERE batch_id = ? AND state <> 'done' AND (state = 'pending' OR claim_until < ?)")
ANY_UNDONE: LiteralString = "SELECT 1 FROM batch_lines WHERE batch_id = ? AND state <> 'done' LIMIT 1"
RESULTS: LiteralString = (
    f"SELECT {LINE_COLUMNS}, {OUTCOME_COLUMNS} FROM batch_lines AS l JOIN batches AS b ON b.id = l.batch_id"
    " WHERE l.batch_id = ? AND l.state = 'done' AND l.line_index > ? ORDER BY l.line_index LIMIT ?")
# Batches running whose every line is done: finalize_ready's.
READY: LiteralString = (
    "SELECT b.id FROM batches AS b WHERE b.status IN ('in_progress', 'cancelling') AND NOT EXISTS"
    " (SELECT 1 FROM batch_lines AS l WHERE l.batch_id = b.id AND l.state <> 'done') ORDER BY b.created_at")
# Parameters: error, finished_at, now. A cancelling batch's lines whose runner died: no runner
# claims them again (claims are of in_progress batches), so they end here.
CANCEL_LAPSED: LiteralString = (
    "UPDATE batch_lines SET state = 'done', claim_until = NULL, outcome = 'cancelled', error = ?, finished_at = ?"
    " WHERE state = 'claimed' AND claim_until < ?"
    " AND batch_id IN (SELECT id FROM batches WHERE status = 'cancelling')")
# The queue's overview (QueueOverview). Each query's WHERE is its partial index's predicate, so
# SQLite reads the index: the running lines and batches, not every one kept.
BATCHES_BY_STATUS: LiteralString = "SELECT status, COUNT(*) FROM batches GROUP BY status"
UNDONE_LINES_BY_STATE: LiteralString = "SELECT state, COUNT(*) FROM batch_lines WHERE state <> 'done' GROUP BY state"
RUNNING_BATCHES: LiteralString = (f"SELECT {BATCH_COLUMNS} FROM batches WHERE status IN ('in_progress', 'cancelling')"
                                  " ORDER BY created_at, id LIMIT ?")
# A batch an upstream runs is not: the upstream ends it, at its own window (its lines' results,
# expired ones included, come back from there).
EXPIRABLE: LiteralString = ("SELECT id FROM batches WHERE status = 'in_progress' AND expires_at <= ?"
                            " AND upstream_batch_id IS NULL ORDER BY created_at")
# Parameters: now, batch_id. expired_at marks it: finalize makes it expired, not completed.
MARK_EXPIRED: LiteralString = ("UPDATE batches SET expired_at = ? WHERE id = ? AND status = 'in_progress'"
                               " AND expired_at IS NULL")
CANCEL: LiteralString = ("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND key_id = ?"
                         " AND status = 'in_progress'")
# Parameters: now, limit. The batches an upstream runs whose lease is free: due for their next
# step (submit, poll, forward a cancel). The lease is also their schedule: set to the next poll.
FORWARDED_DUE: LiteralString = (
    f"SELECT {BATCH_COLUMNS} FROM batches WHERE upstream IS NOT NULL AND status IN ('in_progress', 'cancelling')"
    " AND (upstream_lease_until IS NULL OR upstream_lease_until <= ?) ORDER BY upstream_lease_until, id LIMIT ?")
# Parameters: until, batch_id, now.
LEASE_FORWARDED: LiteralString = ("UPDATE batches SET upstream_lease_until = ? WHERE id = ?"
                                  " AND (upstream_lease_until IS NULL OR upstream_lease_until <= ?)")
# Parameters: upstream_batch_id, next poll, batch_id. Kept only for a batch still to run: one
# cancelled or expired meanwhile is the caller's to cancel there.
SET_UPSTREAM_ID: LiteralString = (
    "UPDATE batches SET upstream_batch_id = ?, upstream_lease_until = ? WHERE id = ? AND upstream_batch_id IS NULL"
    " AND status = 'in_progress' AND expired_at IS NULL")
# A line's outcome as the upstream's results give it: written once, whichever poll comes first.
FINISH_FORWARDED: LiteralString = (
    "UPDATE batch_lines SET state = 'done', claim_until = NULL, outcome = ?, status_code = ?, response = ?, error = ?,"
    " request_id = ?, finished_at = ? WHERE batch_id = ? AND line_index = ? AND state <> 'done'")
# The final status's own time; an expired batch keeps the time it expired at.
_SET_FINAL: LiteralString = "UPDATE batches SET status = ?, finalizing_at = ?, output_file_id = ?, error_file_id = ?, "
_WHERE_FINAL: LiteralString = " WHERE id = ? AND status = ?"
FINAL_STATUS_TO_UPDATE: dict[BatchStatus, LiteralString] = {
    "completed": _SET_FINAL + "completed_at = ?" + _WHERE_FINAL,
    "cancelled": _SET_FINAL + "cancelled_at = ?" + _WHERE_FINAL,
    "expired": _SET_FINAL + "expired_at = COALESCE(expired_at, ?)" + _WHERE_FINAL,
}


def dumps(value: Any) -> str:
    # allow_nan=False: NaN is not JSON; what one database keeps, the other must take too.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def loads_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def file_from_row(row: Sequence[Any]) -> StoredFile:
    file_id, key_id, purpose, filename, num_bytes, created_at, expires_at = row
    return StoredFile(file_id, key_id, cast(FilePurpose, purpose), filename, num_bytes, created_at, expires_at)


def batch_row(batch: Batch) -> tuple:
    return (batch.id, batch.key_id, batch.api, batch.endpoint, batch.input_file_id, batch.status, batch.created_at,
            batch.expires_at, *(batch.status_times.get(name) for name in STATUS_TIME_FIELDS),
            None if batch.metadata is None else dumps(batch.metadata), dumps(list(batch.errors)),
            batch.output_file_id, batch.error_file_id, batch.model, batch.upstream, batch.upstream_batch_id)


def batch_from_row(row: Sequence[Any], counts: BatchCounts) -> Batch:
    batch_id, key_id, api, endpoint, input_file_id, status, created_at, expires_at = row[:8]
    times = row[8:8 + len(STATUS_TIME_FIELDS)]
    metadata, errors, output_file_id, error_file_id, model, upstream, upstream_batch_id = \
        row[8 + len(STATUS_TIME_FIELDS):]
    status_times = {name: value for name, value in zip(STATUS_TIME_FIELDS, times, strict=True) if value is not None}
    return Batch(batch_id, key_id, cast(BatchApi, api), endpoint, input_file_id, cast(BatchStatus, status), created_at,
                 expires_at, status_times, loads_or_none(metadata), tuple(json.loads(errors)), output_file_id,
                 error_file_id, counts, model, upstream, upstream_batch_id)


def line_from_row(row: Sequence[Any]) -> BatchLine:
    batch_id, index, custom_id, body, endpoint, key_id, api = row[:7]
    return BatchLine(batch_id, index, custom_id, json.loads(body), endpoint, key_id, cast(BatchApi, api),
                     line_id_of(batch_id, index))


def outcome_from_row(row: Sequence[Any]) -> LineOutcome:
    outcome, status_code, response, error, request_id = row
    return LineOutcome(cast(Outcome, outcome), status_code, loads_or_none(response), loads_or_none(error), request_id)


def counts_from_rows(batch_ids: Sequence[str], rows: Iterable[Sequence[Any]]) -> dict[str, BatchCounts]:
    """rows: (batch_id, outcome or None while not done, how many)."""
    batch_id_to_tally: dict[str, dict[str, int]] = {batch_id: {} for batch_id in batch_ids}
    for batch_id, outcome, num in rows:
        batch_id_to_tally[batch_id][outcome or "pending"] = num
    return {batch_id: BatchCounts(sum(tally.values()), tally.get("succeeded", 0), tally.get("failed", 0),
                                  tally.get("cancelled", 0), tally.get("expired", 0), tally.get("pending", 0))
            for batch_id, tally in batch_id_to_tally.items()}


def counts_sql(num_batches: int) -> LiteralString:
    return (f"SELECT batch_id, outcome, COUNT(*) FROM batch_lines WHERE batch_id IN ({marks(num_batches)})"
            " GROUP BY batch_id, outcome")
