"""A batch line's attempt refused for now (Call.deferred) writes no ledger row, so the row its
line ends with, under the same id, is the one that bills it; every other ending writes its row
as any call's does (gateway/call.py, Gatekeeper.commit). End to end, with the runner and both
batch APIs on both ledgers: tests/e2e/test_batches_deferred.py."""

from __future__ import annotations

import asyncio

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Answer, Call, CallOutcome, CallStart, RouteChoice
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.routing.router import ReplicaChoice
from tokenway.server.gateway_middleware import answer_of

MODEL = "m"
KEY = Principal(key_id="k_batch", name="batch")
LINE = "AAAAl0"
# $0.001 a token, in and out, and half that at the batch tier: a line's row costs its tokens / 2000.
PRICES = PriceTable.from_config({MODEL: {"input": 1000.0, "cached_input": 1000.0, "output": 1000.0}})


@pytest.fixture()
def gatekeeper(tmp_path):
    return Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), Ledger(f"sqlite:///{tmp_path / 'l.db'}"),
                      PRICES, Defaults(), host="127.0.0.1")


def attempt(answer: Answer, outcome: CallOutcome, *, batch_line: str | None = LINE,
            replica: str | None = None) -> Call:
    """A call as the gateway ends it: answered `answer`, its outcome `outcome`, run by `replica`
    (None: refused before any replica was chosen)."""
    call = Call(CallStart("/v1/chat/completions", KEY, "req_x", 0.0, batch_line=batch_line))
    call.set_route(RouteChoice(MODEL, MODEL))
    if replica is not None:
        call.set_replica(ReplicaChoice(MODEL, replica, "only"))
    call.set_answer(answer)
    call.end(outcome)
    return call


SERVED = CallOutcome(200, prompt_tokens=30, completion_tokens=8, finish_reason="length")
CONCURRENCY = CallOutcome(429, error="Rate limit reached for max_concurrent", limit_kind="max_concurrent")


def rows_after(gatekeeper: Gatekeeper, *calls: Call) -> list:
    async def main():
        for call in calls:
            await gatekeeper.commit(call, call.answer.status if call.answer is not None else 0)
        rows = await gatekeeper.ledger.recent(10)
        await gatekeeper.close()
        return rows

    return asyncio.run(main())


def test_a_deferred_attempt_leaves_the_line_its_served_row(gatekeeper):
    refused = [attempt(Answer(429, 1.0), CONCURRENCY), attempt(Answer(503, 2.0), CallOutcome(503, error="full"))]
    served = attempt(Answer(200), SERVED, replica="local")
    assert all(call.deferred for call in refused) and not served.deferred
    [row] = rows_after(gatekeeper, *refused, served)
    assert (row.request_id, row.status, row.prompt_tokens, row.completion_tokens) == ("req_x", 200, 30, 8)
    assert row.cost_usd == pytest.approx(0.019) and row.service_tier == "batch"


def test_endings_that_are_the_lines_outcome_write_their_row(gatekeeper):
    # No Retry-After (a budget used up): final, not run again, so its row is the line's.
    used_up = attempt(Answer(429), CallOutcome(429, error="budget used", limit_kind="budget"))
    # A replica had begun it: billed for what it generated, whatever the status.
    started = attempt(Answer(503, 1.0), CallOutcome(503, prompt_tokens=30, completion_tokens=3), replica="local")
    # Not a batch line: a client's 429 is its own outcome.
    network = attempt(Answer(429, 1.0), CONCURRENCY, batch_line=None)
    assert not (used_up.deferred or started.deferred or network.deferred)
    # Three calls under one id: the ledger keeps the first (insert is idempotent by request id).
    [row] = rows_after(gatekeeper, used_up, started, network)
    assert (row.status, row.prompt_tokens, row.error) == (429, 0, "budget used")


def test_a_started_attempt_is_billed_for_its_tokens(gatekeeper):
    [row] = rows_after(gatekeeper, attempt(Answer(503, 1.0), CallOutcome(503, prompt_tokens=30, completion_tokens=3),
                                           replica="local"))
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (503, 30, 3)
    assert row.cost_usd == pytest.approx(0.0165)


def test_answer_of_reads_the_finest_retry_after_sent():
    assert answer_of(429, [(b"Retry-After", b"2"), (b"retry-after-ms", b"1500")]) == Answer(429, 1.5)
    assert answer_of(503, [(b"retry-after", b"3")]) == Answer(503, 3.0)
    assert answer_of(503, [(b"retry-after", b"Wed, 21 Oct 2015 07:28:00 GMT")]) == Answer(503)
    assert answer_of(429, [(b"content-type", b"application/json")]) == Answer(429)
