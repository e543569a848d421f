"""Stage 7 of the path: what a request cost, and the durable record of it.

    usage (prompt, cached, completion tokens) + PriceTable.price(model) -> cost_usd
    -> UsageRecord -> Ledger.record(): one row per request_id, journaled, then group-committed by
    a writer thread that waits out the database's outages (writer.py)
    Ledger.usage() (per key, UTC day and model) and Ledger.spend_usd() (budgets: committed + pending) read it back.
"""

from tokenway.billing.ledger import Ledger, LedgerHealth, LedgerUnavailable, UsageRecord
from tokenway.billing.pricing import ModelPrice, PriceTable, cost_usd

__all__ = ["Ledger", "LedgerHealth", "LedgerUnavailable", "ModelPrice", "PriceTable", "UsageRecord", "cost_usd"]
