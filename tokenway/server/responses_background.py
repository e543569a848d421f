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

BackgroundResponses (responses_tasks.py) is the registry Services holds; this module runs one.

A cancel that reaches another gateway than the one running the response marks it cancelled in
the store; that runner's result is then refused by the store's conditional update.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tokenway.conversations import ResponseStore
from tokenway.gateway.call import Call, CallStart
from tokenway.observability.traces import Trace
from tokenway.protocol.errors import InternalServerError, TokenwayError
from tokenway.protocol.responses_bodies import Response
from tokenway.server.generation import Generation
from tokenway.server.responses_output import OutputItems
from tokenway.server.responses_render import failed, response_json
from tokenway.server.responses_tasks import BackgroundResponses
from tokenway.server.services import Services

logger = logging.getLogger(__name__)

SHUTDOWN = "The server shut down before the response finished; create it again."


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
