"""BatchBackend: one connection to the batch store's database, used by one thread at a time; the
store's operations as SQL (schema.py's), the same on both dialects. A dialect (SqliteBatchBackend,
PostgresBatchBackend) gives the connection, its transactions and its row locks:

    SQLite: a writer transaction (BEGIN IMMEDIATE) takes the file's one write lock, so claims,
        finalization and cancels are serialized, across processes too.
    PostgreSQL: claims lock the lines they take (FOR UPDATE ... SKIP LOCKED: concurrent
        claimers pass over each other's rows, never wait on them); finalization locks its batch's row.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, LiteralString, Protocol, cast

from tokenway.batches import schema
from tokenway.batches.lines import CANCELLED_ERROR, EXPIRED_ERROR, result_files
from tokenway.batches.packed import PackedLines
from tokenway.batches.schema import dumps
from tokenway.batches.store import (
    FINAL_STATUSES,
    MAX_ATTEMPTS,
    Batch,
    BatchApi,
    BatchCounts,
    BatchLine,
    BatchStatus,
    FilePurpose,
    JSONObject,
    LineOutcome,
    QueueOverview,
    StoredFile,
    line_id_of,
    new_file_id,
)
from tokenway.protocol.errors import FieldError, truncate

IN_BATCH = 500  # values an IN (...) list: far below either database's bound on parameters
RESULTS_PAGE = 500
NO_LIMIT = 2**62  # a LIMIT both dialects take as none (PostgreSQL refuses SQLite's -1)


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


def chunks(values: Sequence[Any], size: int = IN_BATCH) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start:start + size]


class BatchBackend:
    LOCK_LINES: LiteralString = ""  # after a SELECT of lines to claim
    LOCK_BATCH: LiteralString = ""  # after a SELECT of the batch to finalize

    def execute(self, sql: LiteralString, params: Sequence[Any] = ()) -> Cursor:
        raise NotImplementedError

    def executemany(self, sql: LiteralString, rows: Sequence[Sequence[Any]]) -> None:
        raise NotImplementedError

    def transaction(self) -> AbstractContextManager[None]:
        """A writer transaction: committed as the block ends, rolled back if it raises."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ---- files ----

    def create_file(self, file: StoredFile, content: bytes) -> None:
        self.execute(schema.INSERT_FILE, (file.id, file.key_id, file.purpose, file.filename, file.bytes,
                                          file.created_at, file.expires_at, content))

    def get_file(self, file_id: str, key_id: str) -> StoredFile | None:
        row = self.execute(f"SELECT {schema.FILE_COLUMNS} FROM files WHERE id = ? AND key_id = ?",
                           (file_id, key_id)).fetchone()
        return None if row is None else schema.file_from_row(row)

    def file_content(self, file_id: str, key_id: str) -> bytes | None:
        row = self.execute("SELECT content FROM files WHERE id = ? AND key_id = ?", (file_id, key_id)).fetchone()
        return None if row is None else bytes(row[0])

    def delete_file(self, file_id: str, key_id: str) -> bool:
        return self.execute("DELETE FROM files WHERE id = ? AND key_id = ?", (file_id, key_id)).rowcount == 1

    def list_files(self, key_id: str, purpose: FilePurpose | None, after: str | None, limit: int,
                   order: Literal["asc", "desc"]) -> tuple[list[StoredFile], bool]:
        where: list[LiteralString] = ["key_id = ?"]
        params: list[Any] = [key_id]
        if purpose is not None:
            where.append("purpose = ?")
            params.append(purpose)
        sort: LiteralString = "DESC" if order == "desc" else "ASC"
        if after is not None:
            row = self.execute("SELECT created_at FROM files WHERE id = ? AND key_id = ?", (after, key_id)).fetchone()
            if row is None:
                raise FieldError("after", f"no file with id {truncate(after)!r}")
            beyond: LiteralString = "<" if order == "desc" else ">"
            where.append(f"(created_at {beyond} ? OR created_at = ? AND id {beyond} ?)")
            params += [row[0], row[0], after]
        rows = self.execute(f"SELECT {schema.FILE_COLUMNS} FROM files WHERE {' AND '.join(where)}"
                            f" ORDER BY created_at {sort}, id {sort} LIMIT ?", (*params, limit + 1)).fetchall()
        return [schema.file_from_row(row) for row in rows[:limit]], len(rows) > limit

    def purge_files(self, now: float, limit: int) -> int:
        """Up to `limit` files past their expires_at, deleted; how many. (A subquery's LIMIT:
        SQLite's DELETE ... LIMIT is a compile-time option.)"""
        return self.execute("DELETE FROM files WHERE id IN (SELECT id FROM files WHERE expires_at IS NOT NULL"
                            " AND expires_at <= ? LIMIT ?)", (now, limit)).rowcount

    # ---- batches ----

    def create_batch(self, batch: Batch, lines: PackedLines) -> None:
        with self.transaction():
            # A retry of a create whose commit's reply was lost: the batch and its lines are there.
            if self.execute(schema.INSERT_BATCH, schema.batch_row(batch)).rowcount == 1:
                # A chunk's rows at a time: never every line's row at once beside the packed lines.
                for start in range(0, len(lines), IN_BATCH):
                    self.executemany(schema.INSERT_LINE, [
                        (batch.id, index, custom_id, body)
                        for index, (custom_id, body) in enumerate(lines.rows(start, start + IN_BATCH), start)])

    def reclaim(self) -> None:
        """Give back the space deleted rows left, where the database does not do so itself."""

    def counts(self, batch_ids: Sequence[str]) -> dict[str, BatchCounts]:
        rows = self.execute(schema.counts_sql(len(batch_ids)), batch_ids).fetchall() if batch_ids else []
        return schema.counts_from_rows(batch_ids, rows)

    def get_batch(self, batch_id: str, key_id: str | None) -> Batch | None:
        """key_id None: whoever owns it (the runner's side)."""
        if key_id is None:
            row = self.execute(f"SELECT {schema.BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            row = self.execute(f"SELECT {schema.BATCH_COLUMNS} FROM batches WHERE id = ? AND key_id = ?",
                               (batch_id, key_id)).fetchone()
        return None if row is None else schema.batch_from_row(row, self.counts([batch_id])[batch_id])

    def list_batches(self, key_id: str, api: BatchApi, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        where: LiteralString = "key_id = ? AND api = ?"
        params: list[Any] = [key_id, api]
        if after is not None:
            row = self.execute("SELECT created_at FROM batches WHERE id = ? AND key_id = ? AND api = ?",
                               (after, key_id, api)).fetchone()
            if row is None:
                raise FieldError("after", f"no batch with id {truncate(after)!r}")
            where += " AND (created_at < ? OR created_at = ? AND id < ?)"
            params += [row[0], row[0], after]
        rows = self.execute(f"SELECT {schema.BATCH_COLUMNS} FROM batches WHERE {where}"
                            " ORDER BY created_at DESC, id DESC LIMIT ?", (*params, limit + 1)).fetchall()
        page = rows[:limit]
        counts = self.counts([row[0] for row in page])
        return [schema.batch_from_row(row, counts[row[0]]) for row in page], len(rows) > limit

    def cancel_batch(self, batch_id: str, key_id: str, now: float) -> bool:
        """Whether it moved to cancelling (it was in_progress)."""
        with self.transaction():
            if self.execute(schema.CANCEL, (now, batch_id, key_id)).rowcount != 1:
                return False
            # A batch an upstream runs: the cancel goes there, and its lines end as its results say.
            if self.execute("SELECT upstream FROM batches WHERE id = ?", (batch_id,)).fetchone()[0] is None:
                self.execute(schema.END_IDLE_LINES, ("cancelled", dumps(CANCELLED_ERROR), now, batch_id, now))
            return True

    def delete_batch(self, batch_id: str, key_id: str) -> BatchStatus | None:
        """The batch's status as it was (deleted only when final); None when the key has none such."""
        with self.transaction():
            row = self.execute(f"SELECT status, output_file_id, error_file_id FROM batches WHERE id = ? AND key_id = ?"
                               f"{self.LOCK_BATCH}", (batch_id, key_id)).fetchone()
            if row is None or row[0] not in FINAL_STATUSES:
                return None if row is None else row[0]
            self.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            for file_id in row[1:]:
                if file_id is not None:
                    self.execute("DELETE FROM files WHERE id = ?", (file_id,))
            self.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
            return row[0]

    # ---- the runners' side ----

    def claim(self, worker_id: str, limit: int, lease_s: float, now: float) -> list[BatchLine]:
        claimed: list[BatchLine] = []
        with self.transaction():
            for batch_id, endpoint, key_id, api in self.execute(schema.CLAIMABLE_BATCHES, (now,)).fetchall():
                rows = self.execute(schema.CLAIMABLE_LINES + self.LOCK_LINES,
                                    (batch_id, now, limit - len(claimed))).fetchall()
                taken = [row for row in rows if row[3] < MAX_ATTEMPTS]
                for indexes in chunks([row[0] for row in taken]):
                    self.execute("UPDATE batch_lines SET state = 'claimed', claimed_by = ?, claim_until = ?,"
                                 " attempts = attempts + 1 WHERE batch_id = ?"
                                 f" AND line_index IN ({schema.marks(len(indexes))})",
                                 (worker_id, now + lease_s, batch_id, *indexes))
                for index, _, _, attempts in (row for row in rows if row[3] >= MAX_ATTEMPTS):
                    error = {"code": "batch_line_abandoned",
                             "message": f"The request was tried {attempts} times, and each time the server running "
                                        "it stopped before it ended."}
                    self.execute("UPDATE batch_lines SET state = 'done', claim_until = NULL, outcome = 'failed',"
                                 " error = ?, finished_at = ? WHERE batch_id = ? AND line_index = ?",
                                 (dumps(error), now, batch_id, index))
                claimed += [BatchLine(batch_id, index, custom_id, json.loads(body), endpoint, key_id,
                                      cast(BatchApi, api), line_id_of(batch_id, index))
                            for index, custom_id, body, _ in taken]
                if len(claimed) >= limit:
                    break
        return claimed

    def renew(self, worker_id: str, lines: Sequence[BatchLine], lease_until: float) -> int:
        num_renewed = 0
        by_batch = sorted(lines, key=lambda line: (line.batch_id, line.index))
        for batch_id, group in itertools.groupby(by_batch, key=lambda line: line.batch_id):
            for indexes in chunks([line.index for line in group]):
                num_renewed += self.execute(
                    "UPDATE batch_lines SET claim_until = ? WHERE batch_id = ? AND state = 'claimed'"
                    f" AND claimed_by = ? AND line_index IN ({schema.marks(len(indexes))})",
                    (lease_until, batch_id, worker_id, *indexes)).rowcount
        return num_renewed

    def finish(self, worker_id: str, line: BatchLine, outcome: LineOutcome, now: float) -> bool:
        return self.execute(schema.FINISH, (
            outcome.outcome, outcome.status_code, None if outcome.response is None else dumps(outcome.response),
            None if outcome.error is None else dumps(outcome.error), outcome.request_id, now, line.batch_id,
            line.index, worker_id)).rowcount == 1

    def defer(self, worker_id: str, line: BatchLine, until: float) -> bool:
        return self.execute(schema.DEFER, (until, line.batch_id, line.index, worker_id)).rowcount == 1

    def ready(self, now: float) -> list[str]:
        """The batches whose lines are all done, after ending the lapsed claims of cancelling ones."""
        self.execute(schema.CANCEL_LAPSED, (dumps(CANCELLED_ERROR), now, now))
        return [row[0] for row in self.execute(schema.READY).fetchall()]

    def finalize(self, batch_id: str, now: float) -> BatchStatus | None:
        """Write the batch's files and final status if every line is done; the status, or None
        when it is not ready (or another call finalized it first).

        The files are made before the writer transaction, so the database's write lock (SQLite's
        is the ledger's too) is held for their inserts only: a line once done never changes, and
        a batch once all done stays so, so the files made before are those the batch ends with."""
        if (batch := self._ready_batch(batch_id, "")) is None:
            return None
        output, errors = result_files(batch.api, self.results_page(batch_id, -1, None))
        with self.transaction():
            if (batch := self._ready_batch(batch_id, self.LOCK_BATCH)) is None:
                return None
            file_ids = [self._output_file(batch, content, kind, now) for content, kind in
                        [(output, "output"), (errors, "error")]]
            final: BatchStatus = ("cancelled" if batch.status == "cancelling" else
                                  "expired" if "expired_at" in batch.status_times else "completed")
            self.execute(schema.FINAL_STATUS_TO_UPDATE[final], (final, now, *file_ids, now, batch_id, batch.status))
            return final

    def _ready_batch(self, batch_id: str, lock: LiteralString) -> Batch | None:
        """The batch, if it is running and every line of it is done (its counts left empty)."""
        row = self.execute(f"SELECT {schema.BATCH_COLUMNS} FROM batches WHERE id = ?{lock}", (batch_id,)).fetchone()
        if row is None or row[5] not in ("in_progress", "cancelling"):
            return None
        if self.execute(schema.ANY_UNDONE, (batch_id,)).fetchone() is not None:
            return None
        return schema.batch_from_row(row, BatchCounts(0))

    def _output_file(self, batch: Batch, content: bytes, kind: str, now: float) -> str | None:
        if not content:
            return None
        file = StoredFile(new_file_id(), batch.key_id, "batch_output", f"{batch.id}_{kind}.jsonl", len(content),
                          now, None)
        self.create_file(file, content)
        return file.id

    def expirable(self, now: float) -> list[str]:
        return [row[0] for row in self.execute(schema.EXPIRABLE, (now,)).fetchall()]

    def mark_expired(self, batch_id: str, now: float) -> None:
        """The batch's lines no runner holds ─► expired; those running keep their claims."""
        with self.transaction():
            self.execute(schema.MARK_EXPIRED, (now, batch_id))
            self.execute(schema.END_IDLE_LINES, ("expired", dumps(EXPIRED_ERROR), now, batch_id, now))

    def results_page(self, batch_id: str, after_index: int, limit: int | None) -> list[tuple[BatchLine, LineOutcome]]:
        """The batch's done lines after line after_index, in order; limit None: all of them."""
        rows = self.execute(schema.RESULTS, (batch_id, after_index, NO_LIMIT if limit is None else limit)).fetchall()
        return [(schema.line_from_row(row), schema.outcome_from_row(row[7:])) for row in rows]

    def overview(self, limit: int) -> QueueOverview:
        by_status = {status: num for status, num in self.execute(schema.BATCHES_BY_STATUS).fetchall()}
        by_state = {state: num for state, num in self.execute(schema.UNDONE_LINES_BY_STATE).fetchall()}
        rows = self.execute(schema.RUNNING_BATCHES, (limit,)).fetchall() if limit else []
        counts = self.counts([row[0] for row in rows])
        return QueueOverview(by_status, by_state.get("pending", 0), by_state.get("claimed", 0),
                             tuple(schema.batch_from_row(row, counts[row[0]]) for row in rows))

    # ---- batches an upstream runs whole ----

    def take_forwarded(self, now: float, lease_s: float, limit: int) -> list[Batch]:
        """Up to `limit` forwarded batches due now, each leased until now + lease_s (their counts
        left empty): no other gateway takes one until its lease passes."""
        taken = []
        with self.transaction():
            for row in self.execute(schema.FORWARDED_DUE + self.LOCK_LINES, (now, limit)).fetchall():
                if self.execute(schema.LEASE_FORWARDED, (now + lease_s, row[0], now)).rowcount == 1:
                    taken.append(schema.batch_from_row(row, BatchCounts(0)))
        return taken

    def lines_of(self, batch_id: str) -> list[tuple[int, str, JSONObject]]:
        rows = self.execute("SELECT line_index, custom_id, body FROM batch_lines WHERE batch_id = ?"
                            " ORDER BY line_index", (batch_id,)).fetchall()
        return [(index, custom_id, json.loads(body)) for index, custom_id, body in rows]

    def set_upstream(self, batch_id: str, upstream_batch_id: str | None, next_at: float) -> bool:
        """Lease the batch until next_at; with upstream_batch_id, record it too if the batch is
        still to run (False: it was cancelled or expired meanwhile, nothing recorded)."""
        if upstream_batch_id is None:
            self.execute("UPDATE batches SET upstream_lease_until = ? WHERE id = ?", (next_at, batch_id))
            return True
        return self.execute(schema.SET_UPSTREAM_ID, (upstream_batch_id, next_at, batch_id)).rowcount == 1

    def finish_forwarded(self, batch_id: str, results: Sequence[tuple[int, LineOutcome]], rest: LineOutcome | None,
                         now: float) -> int:
        """Each line's outcome, unless it is done already; then, with `rest`, every line still
        undone ends so. How many of `results` were written."""
        num_written = 0
        with self.transaction():
            for index, outcome in results:
                num_written += self.execute(schema.FINISH_FORWARDED, (
                    outcome.outcome, outcome.status_code, None if outcome.response is None else dumps(outcome.response),
                    None if outcome.error is None else dumps(outcome.error), outcome.request_id, now, batch_id,
                    index)).rowcount
            if rest is not None:
                self.execute(schema.END_IDLE_LINES, (rest.outcome, None if rest.error is None else dumps(rest.error),
                                                     now, batch_id, now))
        return num_written

    def owns(self, batch_id: str, key_id: str) -> bool:
        return self.execute("SELECT 1 FROM batches WHERE id = ? AND key_id = ?", (batch_id, key_id)).fetchone() \
            is not None

