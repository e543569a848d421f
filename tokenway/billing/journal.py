"""A local append-only journal in front of the ledger database.

A response's last byte must not leave before its ledger row would survive a crash, yet a
database commit on that path costs milliseconds (bench/gateway_bench.py: +2.8 ms p50 with
SQLite). So the row is first appended to this file with one write(2) call (~20 us): once
write returns, the row is in the kernel's page cache and survives the process being killed
(kill -9, an OOM kill, a crash); the database commit then happens in batches off the
request path. When everything appended has been committed the file is emptied (back to its
header); on start-up, rows still in it (a crash between append and commit) are committed
again, which is harmless since ledger inserts are idempotent by request_id. (Surviving power
loss too would take an fsync per batch; ask for it with fsync=True.) While the database is
down the file is the rows' only copy: the ledger's writer keeps only their count, and once the
database is back commits the file's rows again from the start (rows(end)), then counts them
committed.

A journal belongs to one database. Its name carries the database's id and its first line
(the header) names the database:

    ledger-<database id>-<gateway name>.journal
    {"journal": "tokenway-ledger", "version": 2, "database": "sqlite:////srv/tokenway.db"}
    {"request_id": ..., ...}                        one UsageRecord per line, ASCII JSON

Each running gateway holds an exclusive flock on its own journal. A gateway that starts
adopts the rows of every sibling journal of the same database that nobody holds (one left by
a gateway that died and came back under another name, or never came back); journals of
other databases in the same folder, and any other file, are never touched. A line that
cannot be read back (torn by a crash mid-write, or damaged) is moved to the dead-letter file,
never dropped and never allowed to stop the start.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from tokenway.billing.dead_letters import DeadLetters
from tokenway.billing.record import COLUMNS, JSON_COLUMNS, UsageRecord
from tokenway.json_codec import dumps_ascii

logger = logging.getLogger(__name__)

MAGIC = "tokenway-ledger"
VERSION = 2


def database_id(database: str) -> str:
    """A short stable id for a database, safe in a file name."""
    return hashlib.sha256(database.encode("utf-8", "backslashreplace")).hexdigest()[:12]


def header_line(database: str) -> bytes:
    return (json.dumps({"journal": MAGIC, "version": VERSION, "database": database}) + "\n").encode()


class Journal:
    """`database` names the ledger database (no password); `name` tells this gateway's journal
    apart from its siblings' (the port, say). Raises ValueError if another live gateway holds it."""

    def __init__(self, folder: str | Path, database: str, name: str, dead_letters: DeadLetters,
                 fsync: bool = False) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.database = database
        self.path = folder / f"ledger-{database_id(database)}-{name}.journal"
        self.fsync = fsync
        self.dead_letters = dead_letters
        self._header = header_line(database)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel when we die
        except BlockingIOError:
            os.close(self._fd)
            raise ValueError(f"ledger journal {self.path} is held by another running gateway") from None
        self._lock = threading.Lock()
        self.recovered = self._read_own()
        # What the file held when opened: a line before it that cannot be read was quarantined then.
        self._num_bytes_read_at_open = os.fstat(self._fd).st_size
        self._adopt_orphans(folder, name)
        if self.recovered:
            logger.warning("ledger journal %s: committing %d rows left by an earlier run", self.path,
                           len(self.recovered))
        # Rows appended but not yet committed: recovered rows count, they are committed anew.
        self._num_appended = len(self.recovered)
        self._num_committed = 0

    def _read_own(self) -> list[UsageRecord]:
        """Our own file's rows, left in place until they are committed."""
        size = os.fstat(self._fd).st_size
        records = read_records(self.path, self.database, self.dead_letters) if size else []
        if records is None:  # a file of our name naming another database: kept aside, never used
            aside = self.path.with_suffix(".foreign")
            os.replace(self.path, aside)
            logger.error("ledger journal %s names another database; moved to %s", self.path, aside)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            records, size = [], 0
        if size == 0:
            os.write(self._fd, self._header)
        elif os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")  # a line torn by a crash: the next row must not extend it
        return records

    def _adopt_orphans(self, folder: Path, name: str) -> None:
        """Move the rows of unheld sibling journals of our database into ours (durably, before
        deleting theirs: a crash in between leaves a row twice, which the idempotent insert
        absorbs). A journal from before journals named their database (`ledger-<port>.journal`)
        is adopted only under its own name: it cannot say which database it belongs to."""
        siblings = sorted(folder.glob(f"ledger-{database_id(self.database)}-*.journal"))
        legacy = folder / f"ledger-{name}.journal"
        if legacy.exists():
            siblings.append(legacy)
        for other in siblings:
            if other == self.path:
                continue
            try:
                fd = os.open(other, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live gateway's
                records = read_records(other, None if other == legacy else self.database, self.dead_letters)
                if records is None:
                    continue  # another database's, however it got its name
                for record in records:
                    self._write(record)
                self.recovered.extend(records)
                if records:
                    logger.warning("ledger journal %s: adopted %d rows of %s, whose gateway is gone", self.path,
                                   len(records), other)
                other.unlink()
            finally:
                os.close(fd)

    def append(self, record: UsageRecord) -> None:
        with self._lock:
            self._write(record)
            self._num_appended += 1

    def _write(self, record: UsageRecord) -> None:
        os.write(self._fd, encode_record(record))  # one O_APPEND write: never interleaved with another
        if self.fsync:
            os.fsync(self._fd)

    def committed(self, count: int) -> None:
        """`count` journaled rows reached the database (or the dead-letter file); empty the
        file once all have."""
        with self._lock:
            self._num_committed += count
            if self._num_committed >= self._num_appended:
                os.ftruncate(self._fd, 0)
                os.write(self._fd, self._header)
                self._num_appended = self._num_committed = 0
                self._num_bytes_read_at_open = 0

    def end(self) -> int:
        """Where the file ends now: after a whole line, since every append is one write(2)."""
        with self._lock:
            return os.fstat(self._fd).st_size

    def rows(self, end: int, batch_max: int) -> Iterator[list[UsageRecord]]:
        """The rows the file holds before byte `end` (an end()), in order, batch_max at a time.
        Only the ledger's writer calls this, and it alone empties the file (committed()), so the
        bytes before `end` stay as they are while they are read."""
        batch: list[UsageRecord] = []
        offset = 0
        with open(self.path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                offset += len(line)
                if offset > end:
                    break
                if number == 1:  # the header, checked when the file was opened
                    continue
                dead_letters = self.dead_letters if offset > self._num_bytes_read_at_open else None
                record = parse_line(line, f"{self.path.name} line {number}", dead_letters)
                if record is not None:
                    batch.append(record)
                if len(batch) == batch_max:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_PLAIN_COLUMNS = tuple(name for name in COLUMNS if name not in JSON_COLUMNS)


def encode_record(record: UsageRecord) -> bytes:
    # ASCII JSON: whatever text a row holds, its line can be written and read back. The fields
    # are read as they are (dataclasses.asdict would deep-copy the trace first: a third of the
    # cost), and the JSON columns are the text the row encoded them to once.
    stages_json, trace_json = record.encoded_json
    fields = dumps_ascii({name: getattr(record, name) for name in _PLAIN_COLUMNS})
    return f'{fields[:-1]},"stages_ms":{stages_json},"trace":{trace_json}}}\n'.encode("ascii")


def read_records(path: Path, database: str | None, dead_letters: DeadLetters) -> list[UsageRecord] | None:
    """The rows in a journal file, or None if its header names a database other than
    `database` (None: accept a file without a header, from before headers). A line that cannot
    be read back is quarantined in the dead-letter file."""
    records = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if number == 1:
                try:
                    entry = json.loads(line.decode("utf-8"))
                except ValueError as exc:  # torn by a crash, or damaged
                    dead_letters.add(f"{path.name} line {number}", f"unreadable: {exc}", raw=line)
                    continue
                if isinstance(entry, dict) and entry.get("journal") == MAGIC:
                    if entry.get("database") != database:
                        return None
                    continue
                if database is not None:
                    logger.warning("ledger journal %s has no header naming its database; not read", path)
                    return None
            record = parse_line(line, f"{path.name} line {number}", dead_letters)
            if record is not None:
                records.append(record)
    return records


def parse_line(line: bytes, source: str, dead_letters: DeadLetters | None) -> UsageRecord | None:
    """The row on one line, or None: a line that cannot be read back goes to `dead_letters`
    (None: it went there already)."""
    try:
        entry = json.loads(line.decode("utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON: torn by a crash, or damaged
        reason = f"unreadable: {exc}"
    else:
        try:
            return UsageRecord(**entry)
        except (ValueError, TypeError) as exc:
            reason = f"not a ledger row: {exc}"
    if dead_letters is not None:
        dead_letters.add(source, reason, raw=line)
    return None
