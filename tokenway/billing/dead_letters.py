"""Where ledger rows go that cannot be stored: kept for an operator, never dropped, never
in the way of the rows behind them.

One ASCII JSON line per row, appended with one write(2):

    {"at": 1795346492.1, "source": "commit", "reason": "OverflowError(...)", "row": {...}}
    {"at": ..., "source": "ledger-3f9a2c1b0d4e-8000.journal line 7", "reason": "unreadable: ...",
     "raw_hex": "7b227265..."}

A row quarantined here counts as handled: its journal entry may be cleared. The count is on
/metrics (tokenway_ledger_quarantined_rows_total) and each one is logged.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class DeadLetters:
    """path None: log only (a ledger without a journal, as in `tokenway usage`)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self.num_rows = 0
        self._lock = threading.Lock()

    def add(self, source: str, reason: str, row: dict | None = None, raw: bytes | None = None) -> None:
        entry: dict = {"at": time.time(), "source": source, "reason": reason[:1000]}
        if row is not None:
            entry["row"] = row
        if raw is not None:
            entry["raw_hex"] = raw.hex()
        try:
            line = json.dumps(entry, default=repr)  # ensure_ascii: any text can be written
        except ValueError:  # an int too long to print, say: keep its repr
            entry["row"] = repr(row)
            line = json.dumps(entry, default=repr)
        with self._lock:
            self.num_rows += 1
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, (line + "\n").encode("ascii"))
                finally:
                    os.close(fd)
        if self.path is not None:
            logger.error("usage ledger: quarantined a row from %s in %s (%s)", source, self.path, reason[:300])
        else:  # no file to keep it in: the log line is its only copy
            logger.error("usage ledger: could not store a row from %s: %s", source, line)
