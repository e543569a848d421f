"""Rows recorded by this process and not yet committed, counted per key: what a key's spend
must include while its rows wait (in the queue, in the journal through an outage)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from tokenway.billing.record import UsageRecord


class Tally:
    """How many rows, and their cost, per key. Not thread-safe: Pending wraps one."""

    def __init__(self) -> None:
        self.key_id_to_rows_usd: dict[str, tuple[int, float]] = {}
        self.num_rows = 0

    @classmethod
    def of(cls, records: Iterable[UsageRecord]) -> Tally:
        tally = cls()
        for rec in records:
            tally.add(rec)
        return tally

    def add(self, rec: UsageRecord) -> None:
        num_rows, usd = self.key_id_to_rows_usd.get(rec.key_id, (0, 0.0))
        self.key_id_to_rows_usd[rec.key_id] = (num_rows + 1, usd + rec.cost_usd)
        self.num_rows += 1


class Pending:
    """Added to by whoever records a row, before it is queued (a spend read once record() has
    returned counts it); taken from by the writer once the row's commit is in the committed
    totals (a read in between counts the row twice for an instant, never zero times)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tally = Tally()

    @property
    def num_rows(self) -> int:
        return self._tally.num_rows

    def usd(self, key_id: str) -> float:
        return self._tally.key_id_to_rows_usd.get(key_id, (0, 0.0))[1]

    def add(self, rec: UsageRecord) -> None:
        with self._lock:
            self._tally.add(rec)

    def remove(self, done: Tally) -> None:
        with self._lock:
            key_id_to_rows_usd = self._tally.key_id_to_rows_usd
            for key_id, (num_rows, usd) in done.key_id_to_rows_usd.items():
                num_left, usd_left = key_id_to_rows_usd[key_id]
                assert num_left >= num_rows, (key_id, num_left, num_rows)
                if num_left > num_rows:
                    key_id_to_rows_usd[key_id] = (num_left - num_rows, usd_left - usd)
                else:  # exactly 0, not what float subtraction leaves
                    del key_id_to_rows_usd[key_id]
            self._tally.num_rows -= done.num_rows
