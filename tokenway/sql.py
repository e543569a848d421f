"""What the stores on a SQL database (the ledger, billing/; the response store, conversations/)
share about it: which failures are the database's outages, and the timeouts libpq needs."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Mapping
from typing import Any

# Seconds; milliseconds.
_PG_TIMEOUTS: dict[str, Any] = {"connect_timeout": 5, "tcp_user_timeout": 15_000}


def is_transient(exc: BaseException) -> bool:
    """A failure of the connection or the server (down, restarting, a dropped connection, a
    lock held past the timeout), which a new connection or a later try may not have."""
    if isinstance(exc, (OSError, sqlite3.OperationalError)):
        return True
    psycopg = sys.modules.get("psycopg")  # looked up, not imported: SQLite-only servers never load it
    return psycopg is not None and isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def pg_timeouts(given: Mapping[str, Any]) -> dict[str, Any]:
    """libpq's timeouts, unless the connection string sets them (`given`: its conninfo_to_dict):
    without them a database host that vanished (no RST, as in a network partition) holds a
    connect(), a query or a COMMIT for minutes, where a store's outage handling wants a prompt
    error to retry after (or answer 503 with)."""
    return {name: value for name, value in _PG_TIMEOUTS.items() if name not in given}
