"""A local append-only journal in front of the ledger database.

A response's last byte must not leave before its ledger row would survive a crash, yet a
database commit on that path costs milliseconds (bench/gateway_bench.py: +2.8 ms p50 with
SQLite). So the row is first appended to this file with one write(2) call (~20 us): once
write returns, the row is in the kernel's page cache and survives the process being killed
(kill -9, an OOM kill, a crash); the database commit then happens in batches off the
request path. When everything appended has been committed the file is truncated; on
start-up, rows still in it (a crash between append and commit) are committed again, which
is harmless since ledger inserts are idempotent by request_id. (Surviving power loss too
would take an fsync per batch; ask for it with fsync=True.)

Each running gateway holds an exclusive flock on its own journal. A gateway that starts
adopts the rows of every sibling journal that nobody holds (same folder, same name up to the
first "-": `ledger-8001.journal` beside `ledger-8000.journal`): one left by a gateway that
died and came back on another port, or never came back. Other files are never touched.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenway.billing.ledger import UsageRecord

logger = logging.getLogger(__name__)


class Journal:
    def __init__(self, path: str | Path, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel when we die
        except BlockingIOError:
            os.close(self._fd)
            raise ValueError(f"ledger journal {self.path} is held by another running gateway") from None
        self._lock = threading.Lock()
        self._adopt_orphans()
        self.recovered = read_records(self.path)
        if self.recovered:
            logger.warning("ledger journal %s: committing %d rows left by an earlier run", self.path,
                           len(self.recovered))
        # Rows appended but not yet committed: recovered rows count, they are committed anew.
        self._num_appended = len(self.recovered)
        self._num_committed = 0

    def _adopt_orphans(self) -> None:
        """Move the rows of unheld sibling journals into ours (durably, before deleting theirs:
        a crash in between leaves a row twice, which the idempotent insert absorbs)."""
        family = f"{self.path.stem.split('-', 1)[0]}*{self.path.suffix}"
        for other in sorted(self.path.parent.glob(family)):
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
                records = read_records(other)
                for record in records:
                    self._write(record)
                if records:
                    logger.warning("ledger journal %s: adopted %d rows of %s, whose gateway is gone", self.path,
                                   len(records), other)
                other.unlink()
            finally:
                os.close(fd)

    def append(self, record: "UsageRecord") -> None:
        with self._lock:
            self._write(record)
            self._num_appended += 1

    def _write(self, record: "UsageRecord") -> None:
        line = (json.dumps(dataclasses.asdict(record), separators=(",", ":")) + "\n").encode()
        os.write(self._fd, line)  # one O_APPEND write: never interleaved with another
        if self.fsync:
            os.fsync(self._fd)

    def committed(self, count: int) -> None:
        """`count` journaled rows reached the database; empty the file once all have."""
        with self._lock:
            self._num_committed += count
            if self._num_committed >= self._num_appended:
                os.ftruncate(self._fd, 0)
                self._num_appended = self._num_committed = 0

    def close(self) -> None:
        os.close(self._fd)


def read_records(path: Path) -> list["UsageRecord"]:
    """The rows in a journal file, skipping a line torn by a crash mid-write."""
    from tokenway.billing.ledger import UsageRecord

    records = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                records.append(UsageRecord(**json.loads(line)))
            except (ValueError, TypeError) as exc:
                logger.warning("ledger journal %s line %d unreadable, skipped: %r", path, number, exc)
    return records
