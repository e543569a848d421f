"""Responses that run detached (background: true): the server owns each as a task, found by
its response id to cancel, and cancelled at shutdown. Its status lives in the store:

    POST /v1/responses {background: true} ─► prepared and admitted on a Call of its own (the
        POST's own Call ends with the 200 that answers it: queued) ─► stored as queued
        ─► BackgroundResponses.spawn ─► run_detached: in_progress ─► the reply ─► completed |
           incomplete | failed, written conditionally (a response cancelled meanwhile stays so)
        ─► its ledger row and trace, from its own Call's outcome, as the middleware makes them
    POST /v1/responses/{id}/cancel ─► stored cancelled ─► BackgroundResponses.cancel: the task's
        generation is closed, which aborts its engine request
    shutdown (cli.py) ─► BackgroundResponses.aclose: every task cancelled, stored as failed
    while it runs ─► usage_so_far, kept with each renewal of its lease; its server killed (no
        shutdown: SIGKILL, a crash, the host gone) ─► the lease passes ─► any server's upkeep
        stores it failed ─► bill_abandoned: its one ledger row, from that usage, and the key's
        budget charged with it

BackgroundResponses (responses_tasks.py) is the registry Services holds; this module runs one.

A cancel that reaches another gateway than the one running the response marks it cancelled in
the store; that runner's result is then refused by the store's conditional update.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import get_args

from tokenway.billing.record import UsageRecord
from tokenway.conversations import ResponseStore, ResponseUsage, StoredResponse
from tokenway.gateway.budgets import BudgetReservation, nanos_down, nanos_up
from tokenway.gateway.call import Call, CallStart
from tokenway.observability.traces import Trace
from tokenway.protocol.errors import InternalServerError, TokenwayError
from tokenway.protocol.job import ServiceClass
from tokenway.protocol.responses_bodies import Response
from tokenway.server.generation import Generation
from tokenway.server.responses_output import OutputItems
from tokenway.server.responses_render import failed, response_json
from tokenway.server.responses_tasks import BackgroundResponses
from tokenway.server.services import Services

logger = logging.getLogger(__name__)

SHUTDOWN = "The server shut down before the response finished; create it again."
# The ledger row's error for a response billed after its server stopped.
SERVER_STOPPED = "server stopped: billed the usage its server last kept"
ABANDONED_STATUS = 500
SERVICE_CLASSES: tuple[ServiceClass, ...] = get_args(ServiceClass)


def detached_call(call: Call) -> Call:
    """A Call of its own for a background response: the same caller, a clock of its own; its
    row and trace are written when it ends, not when the POST that made it is answered."""
    start = call.start
    return Call(CallStart(start.endpoint, start.principal, start.request_id, time.time(), start.traceparent,
                          start.batch_line))


async def run_detached(services: Services, background: BackgroundResponses, store: ResponseStore,
                       generation: Generation, base: Response, items: OutputItems) -> None:
    """A background response's run, to its end whatever ends it; every outcome is stored (a
    status the store already holds as final is kept) and billed."""
    response_id = generation.request_id
    background.follow(response_id, partial(usage_so_far, generation))
    try:
        await _save(store, base)  # in_progress
        response = await response_json(base, generation, items, None)
    except asyncio.CancelledError:
        shutdown = background.closing
        generation.finish(499, "server shut down" if shutdown else "cancelled")
        if shutdown:
            await _save(store, failed(base, generation, items, InternalServerError(SHUTDOWN)))
    except TokenwayError as exc:
        generation.finish(exc.status, exc.message)
        await _save(store, failed(base, generation, items, exc))
    except Exception:
        logger.exception("background response %s failed", response_id)
        generation.finish(500, "internal error")
        await _save(store, failed(base, generation, items, InternalServerError()))
    else:
        generation.finish()
        await _save(store, response)
    finally:
        await record(services, generation.call)


async def _save(store: ResponseStore, response: Response) -> None:
    """Write the response's status; a store that is down loses this state of it (logged): the
    call's ledger row must still be written."""
    try:
        await store.update(response["id"], status=response["status"], response=dict(response))
    except TokenwayError as exc:
        logger.warning("background response %s: its %s state is not stored: %s", response["id"],
                       response["status"], exc.message)


async def record(services: Services, call: Call) -> None:
    """A detached call's ledger row and trace, as GatewayMiddleware writes them for a call it
    answers: from the one outcome (Generation.finish made it)."""
    gatekeeper = services.gatekeeper
    try:
        if gatekeeper is not None:
            await gatekeeper.commit(call)
    finally:
        call.clock.finish()
        call.end_as_sent(0)  # a call that never got an outcome of its own is a 499
        outcome = call.outcome
        assert outcome is not None, "end_as_sent makes one where the call had none"
        if services.observer is not None:
            cost = gatekeeper.call_cost_usd(call, outcome) if gatekeeper is not None else 0.0
            services.observer.record(Trace.of_call(call, outcome, cost))


def usage_so_far(generation: Generation) -> ResponseUsage:
    """What the generation has used: nothing until a replica began it (as Call bills a call
    that fails before its replica started), then its prompt and the tokens made so far."""
    replica = generation.call.replica
    if replica is None or not replica.replica:
        return ResponseUsage()
    reported = generation.reported
    num_prompt_tokens = reported.prompt_tokens if reported is not None else generation.num_prompt_tokens
    return ResponseUsage(num_prompt_tokens, min(generation.num_cached_tokens, num_prompt_tokens),
                         generation.num_completion_tokens)


async def bill_abandoned(services: Services, stored: StoredResponse) -> None:
    """The one ledger row of a background response whose server stopped while it ran (stored
    failed by this server's upkeep): its usage as that server last kept it, at the model's
    price for its tier, under its request id (its response id); and the key's budget charged
    with that cost, as a call's settlement charges it. Nothing where the row exists already
    (its server wrote it, then stopped before its last state was stored)."""
    gatekeeper = services.gatekeeper
    if gatekeeper is None:
        return
    ledger = gatekeeper.ledger
    if await ledger.get(stored.id) is not None:
        return
    usage = stored.usage
    tier = stored.response.get("service_tier")
    tier = tier if tier in SERVICE_CLASSES else "default"
    cost = gatekeeper.prices.cost_usd(stored.model, usage.prompt_tokens, usage.cached_tokens,
                                      usage.completion_tokens, tier)
    # Reserved before the row exists: a key's spend seeded from the ledger now must not count
    # it already, or the settlement below would count it twice.
    reservation = await _budget_hold(services, stored.key_id) if cost > 0 else None
    row = UsageRecord(
        request_id=stored.id, key_id=stored.key_id, model=stored.model, prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens, cost_usd=cost,
        finish_reason=None, error=SERVER_STOPPED, status=ABANDONED_STATUS, stages_ms={},
        started_at=stored.created_at, finished_at=time.time(), trace={"endpoint": "/v1/responses"},
        service_tier=tier)
    try:
        await ledger.record(row)
    finally:
        if reservation is not None:  # kept and replayed if the store is down now, as a call's settlement
            budgets, used_nanos = gatekeeper.budgets, nanos_up(cost)
            await gatekeeper.guard.settle("budgets", lambda: budgets.settle(reservation, used_nanos))
    if services.observer is not None:
        services.observer.record(Trace.from_usage_record(row))


async def _budget_hold(services: Services, key_id: str) -> BudgetReservation | None:
    """A reservation of nothing on the key's budget, to settle to the abandoned response's cost:
    the key's spend grows by it in whichever store holds its budget (this process, the
    supervisor of --workers N, a Redis). None for a key without a budget (or revoked), one
    that has spent it all (the next seed from the ledger counts the row), or a store that
    cannot answer now (likewise)."""
    gatekeeper = services.gatekeeper
    assert gatekeeper is not None
    principal = gatekeeper.keys.principal(key_id)
    if principal is None or principal.budget_usd is None:
        return None
    try:
        budgets, budget_nanos = gatekeeper.budgets, nanos_down(principal.budget_usd)
        decision = await gatekeeper.guard.call("budgets", lambda: budgets.reserve(key_id, budget_nanos, 0))
    except Exception as exc:  # noqa: BLE001 - whatever the store's failure, the row is still written
        logger.warning("background response of key %s: its budget is not charged now: %r", key_id, exc)
        return None
    return decision.reservation
