"""The Batch APIs' files, batches and their lines, kept in the ledger's database, and the runner
that works through them on the capacity interactive traffic leaves.

    server/files_api.py, batches_api.py, message_batches_api.py ── StoredFile, Batch ──► BatchStore (store.py)
        SqlBatchStore (database.py): the queries on threads of its own; outages ─► 503
            BatchBackend (backend.py): SqliteBatchBackend, PostgresBatchBackend
    BatchRunner (runner.py): claim ─► execute(BatchLine) ─► LineOutcome ─► finish; finalize, expire
    result lines (lines.py): OpenAI's output and error lines, Anthropic's results lines
"""

from tokenway.batches.store import (
    BATCH_STATUSES,
    ENDPOINTS,
    FINAL_STATUSES,
    MAX_ATTEMPTS,
    STATUS_TIME_FIELDS,
    Batch,
    BatchApi,
    BatchCounts,
    BatchLine,
    BatchNotEndedError,
    BatchStatus,
    BatchStore,
    BatchStoreUnavailable,
    FilePurpose,
    LineOutcome,
    Outcome,
    Page,
    QueueOverview,
    StoredFile,
    line_id_of,
    new_batch,
    new_batch_id,
    new_file_id,
    open_batch_store,
)

__all__ = ["BATCH_STATUSES", "ENDPOINTS", "FINAL_STATUSES", "MAX_ATTEMPTS", "STATUS_TIME_FIELDS", "Batch",
           "BatchApi", "BatchCounts", "BatchLine", "BatchNotEndedError", "BatchStatus", "BatchStore",
           "BatchStoreUnavailable", "FilePurpose", "LineOutcome", "Outcome", "Page", "QueueOverview", "StoredFile",
           "line_id_of", "new_batch", "new_batch_id", "new_file_id", "open_batch_store"]
