"""The ledger's writer thread: group commit, and riding out the database's outages.

    Ledger._submit ─► jobs ─► LedgerWriter: a batch (up to batch_max rows) ─► one INSERT ... ON
    CONFLICT (request_id) DO NOTHING transaction ─► spend totals, journal.committed, pending, waiters
                                 │ the database fails, and a new connection does too
                                 ▼
    degraded: rows still come off the queue and wait where they are safe: a journaled row in the
    journal (the writer keeps only how many, and their cost per key), a row without a journal in
    memory (up to max_pending_rows: past it, it is dropped, logged and counted). Every 0.2 s,
    doubling to 5 s (jittered, so gateways sharing the database do not retry in step), the writer
    connects again; once it gets through it commits the rows in memory, then the journal's rows
    from its start (a row committed before is a no-op), and is healthy again. The log gets one
    line when an outage starts, one when it ends, and one every WARN_EVERY_S in between.

Only this thread touches the connection, the spend totals and the counters; other threads read
the totals and counters (one dict lookup or int read) and `outage` (a frozen value, swapped whole).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from tokenway.billing.dead_letters import DeadLetters
from tokenway.billing.journal import Journal
from tokenway.billing.pending import Pending, Tally
from tokenway.billing.record import UsageRecord
from tokenway.billing.store import LedgerStore, LedgerUnavailable, is_row_fault, open_store

logger = logging.getLogger(__name__)

RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0
WARN_EVERY_S = 30.0
# A journaled row nobody waits for is safe already (record() returned once it was journaled), so
# its commit waits this long for batch-mates: the writer then wakes once a window rather than once
# a row, and a gateway at 300 calls/s makes ~20 commits a second instead of 300, each a SQLite
# or PostgreSQL transaction and a journal truncation taken off the event loop's GIL
# (bench/gateway_peers.sh: about a sixth of the gateway's CPU time per call).
JOURNALED_WINDOW_S = 0.05


@dataclass(slots=True)
class Write:
    rec: UsageRecord
    # Settled once the row is committed (or quarantined), or for a journaled row, left to wait
    # out an outage in the journal; None: nobody waits.
    waiter: Future | None
    journaled: bool = False


@dataclass(slots=True)
class Seed:
    """Load one key's spend from the DB into the running totals, in the writer's commit order."""

    key_id: str
    waiter: Future


STOP = None  # queue sentinel: flush what is queued, then exit


@dataclass(frozen=True, slots=True)
class Outage:
    since: float  # unix time of the failure that began it
    last_error: str  # the latest failure, as repr()


class LedgerWriter:
    def __init__(self, url: str, store: LedgerStore, journal: Journal | None, dead_letters: DeadLetters,
                 pending: Pending, batch_max: int, max_delay_s: float, max_pending_rows: int) -> None:
        self.url = url
        self.journal = journal
        self.dead_letters = dead_letters
        self.pending = pending
        self.batch_max, self.max_delay_s, self.max_pending_rows = batch_max, max_delay_s, max_pending_rows
        self.jobs: queue.SimpleQueue[Write | Seed | None] = queue.SimpleQueue()
        self.stopping = False
        # Committed spend of the keys asked about: seeded from the DB, then this process's commits.
        self.key_id_to_spend_usd: dict[str, float] = {}
        self.num_commits = 0
        self.num_rows_written = 0
        self.num_rows_dropped = 0  # rows without a journal past max_pending_rows in an outage: lost
        self.outage: Outage | None = None
        self._store: LedgerStore | None = store
        self._held: deque[Write] = deque()  # rows without a journal, waiting out an outage, oldest first
        self._spilled = Tally()  # journaled rows that wait in the journal alone
        self._retry_delay_s = RETRY_FIRST_S
        self._retry_at = 0.0  # time.monotonic() of the next attempt
        self._warned_at = 0.0
        self._num_dropped_at_start = 0
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Write | Seed) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.stopping = True
        self.jobs.put(STOP)

    def join(self) -> None:
        self._thread.join()

    def unavailable(self) -> LedgerUnavailable:
        outage = self.outage
        since = "" if outage is None else f" for {time.time() - outage.since:.0f} s ({outage.last_error})"
        return LedgerUnavailable(f"the usage ledger's database is unreachable{since}",
                                 retry_after_s=max(1.0, self._retry_at - time.monotonic()))

    # ---- the loop ----

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = self._next_batch(None if self.outage is None else max(0.0, self._retry_at - time.monotonic()))
            stopping = bool(batch) and batch[-1] is STOP
            writes = [job for job in batch if isinstance(job, Write)]
            if writes and self.outage is None:
                self._commit(writes)
            elif writes:
                self._park(writes)
            for job in batch:
                if isinstance(job, Seed):
                    self._seed(job)
            if self.outage is not None and (stopping or time.monotonic() >= self._retry_at):
                self._recover()
        if self.outage is not None:
            self._give_up()
        close_quietly(self._store)
        # A record() that raced close() past its check: fail it rather than leave it waiting.
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            if isinstance(job, Write):
                self.pending.remove(Tally.of([job.rec]))
            if isinstance(job, (Write, Seed)):  # not STOP
                _settle([job.waiter], RuntimeError("ledger is closed"))

    def _next_batch(self, timeout: float | None) -> list[Write | Seed | None]:
        """Block for one job (up to `timeout`: [] when none came), then take whatever else is
        queued (waiting up to max_delay_s for more, or JOURNALED_WINDOW_S for a first job that is a
        journaled row nobody waits for) until batch_max; a stop takes everything left."""
        try:
            first = self.jobs.get(timeout=timeout)
        except queue.Empty:
            return []
        batch = [first]
        if isinstance(first, Write) and first.journaled and first.waiter is None and not self.stopping:
            time.sleep(JOURNALED_WINDOW_S)  # what comes meanwhile is queued without waking this thread
        deadline = time.monotonic() + self.max_delay_s
        while batch[-1] is not STOP and len(batch) < self.batch_max:
            try:
                timeout = deadline - time.monotonic()
                batch.append(self.jobs.get(timeout=timeout) if timeout > 0 else self.jobs.get_nowait())
            except queue.Empty:
                break
        if batch[-1] is not STOP and self.stopping:  # STOP may still be queued behind a full batch
            batch.extend(iter(self.jobs.get, STOP))  # stop() puts STOP right after setting stopping
            batch.append(STOP)
        return batch

    # ---- healthy ----

    def _commit(self, writes: list[Write]) -> None:
        num_handled, written, error = self._store_rows([job.rec for job in writes], tries=2)
        self._account(writes[:num_handled], written)
        if error is not None:
            self._begin_outage(error)
            self._park(writes[num_handled:])

    def _seed(self, job: Seed) -> None:
        total = self.key_id_to_spend_usd.get(job.key_id)
        if total is None and self.outage is None:
            for attempt in range(2):  # the connection may be one the database dropped since
                try:
                    self._store = self._store or open_store(self.url)
                    total = self.key_id_to_spend_usd[job.key_id] = self._store.spend_usd(job.key_id)
                    break
                except Exception as exc:
                    close_quietly(self._store)
                    self._store = None
                    if attempt == 1:
                        self._begin_outage(exc)
        _settle([job.waiter], self.unavailable() if total is None else total)

    def _account(self, done: list[Write], written: list[UsageRecord]) -> None:
        """`done` rows are in the database (`written` of them by this commit) or quarantined."""
        self._add_written(written)
        num_journaled = sum(job.journaled for job in done)
        if num_journaled:
            assert self.journal is not None  # rows are journaled only where there is a journal
            self.journal.committed(num_journaled)
        self.pending.remove(Tally.of(job.rec for job in done))  # after the totals: never counted zero times
        _settle([job.waiter for job in done], None)

    def _add_written(self, written: list[UsageRecord]) -> None:
        self.num_rows_written += len(written)
        for rec in written:
            total = self.key_id_to_spend_usd.get(rec.key_id)
            if total is not None:  # unseeded keys are summed from the DB when first asked
                self.key_id_to_spend_usd[rec.key_id] = total + rec.cost_usd

    def _store_rows(self, records: list[UsageRecord], tries: int) -> tuple[int, list[UsageRecord], Exception | None]:
        """Commit `records` in order: (how many were handled, those newly written, None), or when
        the database fails, (how many were handled before, those written, the error). A row whose
        values the backend refuses is found by committing one at a time and quarantined, so the
        rows behind it go through; it counts as handled."""
        written, error = self._insert(records, tries)
        if error is None:
            return len(records), written, None
        if not is_row_fault(error):
            return 0, [], error
        written = []
        for index, rec in enumerate(records):
            rows, error = self._insert([rec], tries=1)
            if error is not None and not is_row_fault(error):
                return index, written, error
            if error is not None:
                self.dead_letters.add("commit", repr(error), row=dataclasses.asdict(rec))
            written += rows
        return len(records), written, None

    def _insert(self, records: list[UsageRecord], tries: int) -> tuple[list[UsageRecord], Exception | None]:
        """(the records written, None) or ([], the last error); connects anew after a failure
        that is not the rows' (a restarted PostgreSQL drops every connection)."""
        error: Exception | None = None
        for _ in range(tries):
            try:
                self._store = self._store or open_store(self.url)
                written = self._store.insert(records)
            except Exception as exc:
                error = exc
                if self._store is not None and is_row_fault(exc):
                    return [], exc  # the same rows would fail again
                close_quietly(self._store)
                self._store = None
                continue
            self.num_commits += 1
            return written, None
        return [], error

    # ---- degraded ----

    def _begin_outage(self, error: Exception) -> None:
        close_quietly(self._store)
        self._store = None
        self.outage = Outage(time.time(), repr(error))
        self._retry_delay_s = RETRY_FIRST_S
        self._retry_at = time.monotonic() + RETRY_FIRST_S * random.uniform(0.5, 1.0)
        self._warned_at = time.monotonic()
        self._num_dropped_at_start = self.num_rows_dropped
        where = "in the journal" if self.journal is not None else f"in memory (up to {self.max_pending_rows})"
        logger.warning("usage ledger: cannot commit to the database (%r); rows wait %s and are retried every "
                       "%.1f-%.0f s until it takes them", error, where, RETRY_FIRST_S, RETRY_MAX_S)

    def _park(self, writes: list[Write]) -> None:
        dropped = []
        for job in writes:
            if job.journaled:
                self._spilled.add(job.rec)
                _settle([job.waiter], None)  # it is safe where it is
            elif len(self._held) < self.max_pending_rows:
                self._held.append(job)
            else:
                dropped.append(job)
        if dropped:
            if self.num_rows_dropped == self._num_dropped_at_start:
                logger.error("usage ledger: %d rows wait in memory for the database, the most allowed "
                             "(max_pending_rows); rows past it are lost until it is back", len(self._held))
            self._drop(dropped)

    def _drop(self, jobs: list[Write]) -> None:
        self.num_rows_dropped += len(jobs)
        self.pending.remove(Tally.of(job.rec for job in jobs))
        _settle([job.waiter for job in jobs], self.unavailable())

    def _recover(self) -> None:
        """One attempt to end the outage: connect, commit the rows in memory, then the journal's."""
        assert self.outage is not None
        try:  # with nothing to commit (an outage a seed ran into) the connection is the test
            self._store = self._store or open_store(self.url)
        except Exception as exc:
            return self._retry_later(exc)
        num_replayed = 0
        while self._held:
            jobs = [self._held[index] for index in range(min(self.batch_max, len(self._held)))]
            num_handled, written, error = self._store_rows([job.rec for job in jobs], tries=1)
            self._account(jobs[:num_handled], written)
            for _ in range(num_handled):
                self._held.popleft()
            num_replayed += num_handled
            if error is not None:
                return self._retry_later(error)
        if self._spilled.num_rows:
            assert self.journal is not None  # rows spill only into a journal
            end = self.journal.end()
            for records in self.journal.rows(end, self.batch_max):
                num_handled, written, error = self._store_rows(records, tries=1)
                self._add_written(written)
                if error is not None:
                    return self._retry_later(error)
            num_replayed += self._spilled.num_rows
            self.journal.committed(self._spilled.num_rows)
            self.pending.remove(self._spilled)
            self._spilled = Tally()
        outage, self.outage = self.outage, None
        num_dropped = self.num_rows_dropped - self._num_dropped_at_start
        logger.info("usage ledger: the database is back after %.1f s; %d rows replayed%s", time.time() - outage.since,
                    num_replayed, f", {num_dropped} lost (past max_pending_rows)" if num_dropped else "")

    def _retry_later(self, error: Exception) -> None:
        assert self.outage is not None  # retries happen during an outage
        self.outage = dataclasses.replace(self.outage, last_error=repr(error))
        self._retry_delay_s = min(RETRY_MAX_S, self._retry_delay_s * 2)
        self._retry_at = time.monotonic() + self._retry_delay_s * random.uniform(0.5, 1.0)
        if time.monotonic() - self._warned_at >= WARN_EVERY_S:
            self._warned_at = time.monotonic()
            logger.warning("usage ledger: the database is still unreachable after %.0f s, %d rows pending "
                           "(%d lost past max_pending_rows): %r", time.time() - self.outage.since,
                           self.pending.num_rows, self.num_rows_dropped - self._num_dropped_at_start, error)

    def _give_up(self) -> None:
        """Stopping while the database is still down (after one last attempt)."""
        if self._held:
            logger.error("usage ledger: closing while the database is unreachable: %d rows recorded without a "
                         "journal are lost", len(self._held))
            self._drop(list(self._held))
            self._held.clear()
        if self._spilled.num_rows:
            assert self.journal is not None  # rows spill only into a journal
            logger.warning("usage ledger: closing while the database is unreachable: %d rows stay in %s for the "
                           "next start", self._spilled.num_rows, self.journal.path)


def _settle(waiters: list[Future | None], outcome: Any) -> None:
    for waiter in waiters:
        if waiter is None:
            continue
        try:  # the caller may have been cancelled (client gone): its row is written all the same
            if isinstance(outcome, BaseException):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)
        except InvalidStateError:
            pass


def close_quietly(store: LedgerStore | None) -> None:
    if store is not None:
        try:
            store.close()
        except Exception as exc:  # already failing: the connection is dropped either way
            logger.debug("usage ledger: closing a failed connection: %r", exc)
