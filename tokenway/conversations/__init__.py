"""What the Responses API (/v1/responses) keeps: each stored response, owned by the key that
made it, in the ledger's database (SQLite or PostgreSQL), or in memory without one.

    server/responses_*.py ── StoredResponse, Turn, InputItemsPage ──► ResponseStore (store.py)
        SqlResponseStore (database.py): the queries on threads of its own; outages ─► 503
            ResponseBackend (backend.py): SqliteBackend (sqlite_backend.py), PostgresBackend (postgres_backend.py)
"""

from tokenway.conversations.store import (
    FINAL_STATUSES,
    RUNNING_STATUSES,
    ConversationTooLongError,
    InputItemsPage,
    PreviousResponseNotFoundError,
    ResponseStatus,
    ResponseStore,
    ResponseStoreUnavailable,
    ResponseUsage,
    StoredResponse,
    Turn,
    open_response_store,
    parse_duration,
    response_not_found,
)

__all__ = ["FINAL_STATUSES", "RUNNING_STATUSES", "ConversationTooLongError", "InputItemsPage",
           "PreviousResponseNotFoundError", "ResponseStatus", "ResponseStore", "ResponseStoreUnavailable",
           "ResponseUsage", "StoredResponse", "Turn", "open_response_store", "parse_duration", "response_not_found"]
