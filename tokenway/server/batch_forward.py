"""Batches handed whole to an upstream that has its own Batch API (a replica with batch_api =
true), instead of running their lines one by one through the router.

    POST /v1/batches, /v1/messages/batches ─► store.create_batch ─► choose(batch, lines): every
        line names one model whose first batch_api replica speaks the batch's API (an openai
        replica takes OpenAI batches, an anthropic one Message Batches) ─► Batch.upstream
        "model/replica"; its lines are never claimed here
    BatchRunner upkeep ─► forwarder() ─► a task over store.take_forwarded (leased: one gateway at
        a time per batch), each batch by its state:
        not submitted         ─► lines' bodies with the upstream's model name ─► submit ─► set_upstream(id)
                                 (cancelled before that: its lines end cancelled, nothing is sent)
        submitted, cancelling ─► cancel there (again at each poll until it ends)
        submitted             ─► poll; ended ─► its results ─► one ledger row a line at the batch
                                 price (committed first) ─► finish_forwarded: each line once; the
                                 lines it does not name end as its status says
    finalize_ready then writes the batch's files as for any batch.

Durable: the upstream's id is on the batch's row; a restarted gateway, or any other on the
database, takes the batch up at its next step once the lease (FORWARD_LEASE_S, longer than a
submission may take) passes. A submission cut off between the upstream's answer and recording
its id is found there again by the metadata naming ours (OpenAI's shape); an Anthropic upstream
keeps none, so that is the one window in which a batch could be sent there twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenway.batches.lines import CANCELLED_ERROR, EXPIRED_ERROR
from tokenway.batches.store import Batch, BatchStore, JSONObject, LineOutcome, line_id_of
from tokenway.gateway.auth import Principal
from tokenway.gateway.call import Call, CallOutcome, CallStart, RouteChoice
from tokenway.gateway.gatekeeper import Gatekeeper
from tokenway.protocol.errors import InvalidRequestError, TokenwayError
from tokenway.routing.registry import Registry
from tokenway.routing.router import Router
from tokenway.routing.upstream_batches import BatchApiShape, UpstreamBatch, UpstreamBatchAPI, usage_of
from tokenway.server.batch_lines import principal_of

logger = logging.getLogger(__name__)

FORWARD_LEASE_S = 900.0  # a step's hold on its batch: above a submission's longest (its requests' timeouts)
DEFAULT_POLL_S = 5.0
MAX_BATCHES_A_STEP = 8
METADATA_KEY = "tokenway_batch_id"  # on an OpenAI-shaped upstream's batch: ours
CANCELLED = LineOutcome("cancelled", None, None, CANCELLED_ERROR)
EXPIRED = LineOutcome("expired", None, None, EXPIRED_ERROR)


@dataclass(frozen=True, slots=True)
class ForwardTarget:
    """The replica a model's batches go to: `key` ("model/replica") is what Batch.upstream holds."""

    key: str
    upstream_model: str
    client: UpstreamBatchAPI


def forward_targets(registry: Registry, router: Router) -> dict[str, ForwardTarget]:
    """Served name or alias -> its model's batch target (ModelEntry.batch_replica), for the
    models that have one."""
    name_to_target: dict[str, ForwardTarget] = {}
    for entry in registry.models:
        spec = entry.batch_replica
        if spec is None:
            continue
        replica = router.pools[entry.name].replicas[spec.name]
        http = getattr(replica, "http", None)
        assert http is not None and spec.model is not None and spec.kind in ("openai", "anthropic"), spec
        shape: BatchApiShape = "anthropic" if spec.kind == "anthropic" else "openai"
        target = ForwardTarget(f"{entry.name}/{spec.name}", spec.model, UpstreamBatchAPI(http, shape))
        name_to_target.update(dict.fromkeys(entry.names, target))
    return name_to_target


class BatchForwarder:
    """choose: the store's hook (store.forward_with) deciding at creation; calling the forwarder
    (the runner's upkeep) starts a step over the batches due, unless one is still under way."""

    def __init__(self, store: BatchStore, name_to_target: Mapping[str, ForwardTarget],
                 gatekeeper: Gatekeeper | None, *, poll_s: float = DEFAULT_POLL_S) -> None:
        self._store = store
        self._name_to_target = dict(name_to_target)
        self._key_to_target = {target.key: target for target in name_to_target.values()}
        self._gatekeeper = gatekeeper
        self._poll_s = poll_s
        self._task: asyncio.Task[None] | None = None

    def choose(self, batch: Batch, models: frozenset[str | None]) -> str | None:
        # One model, by its name or an alias: one target for every line.
        keys = {target.key if model is not None and (target := self._name_to_target.get(model)) is not None
                and target.client.shape == batch.api else None for model in models}
        return keys.pop() if len(keys) == 1 else None

    async def __call__(self) -> None:
        if self._key_to_target and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._step(), name="batch-forward")

    async def aclose(self) -> None:
        """Stop a step under way: its batches' leases lapse, and a later step takes them up."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _step(self) -> None:
        try:
            batches = await self._store.take_forwarded(time.time(), FORWARD_LEASE_S, MAX_BATCHES_A_STEP)
        except Exception:  # an outage: the runner's next upkeep tries again
            logger.warning("batch forwarder: the store could not be read", exc_info=True)
            return
        await asyncio.gather(*(self._drive(batch) for batch in batches))

    async def _drive(self, batch: Batch) -> None:
        next_at = time.time() + self._poll_s
        target = self._key_to_target.get(batch.upstream or "")
        try:
            if target is None:  # this gateway's config has no such replica: another's may
                logger.warning("batch %s: its upstream %s is not in this gateway's config", batch.id, batch.upstream)
                next_at = time.time() + FORWARD_LEASE_S
            elif batch.upstream_batch_id is None:
                await self._submit(batch, target)
            else:
                await self._poll(batch, target, batch.upstream_batch_id)
        except TokenwayError as exc:
            if isinstance(exc, InvalidRequestError) and batch.upstream_batch_id is None:
                # The upstream refused the batch: its lines fail, with its reason.
                logger.warning("batch %s: upstream %s refused it: %s", batch.id, batch.upstream, exc.message)
                await self._store.finish_forwarded(batch.id, [], LineOutcome(
                    "failed", None, None, {"code": "upstream_refused", "message": exc.message}))
            else:  # down, overloaded, rate limiting: try again later
                logger.warning("batch %s: upstream %s: %s", batch.id, batch.upstream, exc.message)
                next_at = time.time() + max(self._poll_s, exc.retry_after or 0.0)
        except Exception:
            logger.exception("batch %s: forwarding to %s failed", batch.id, batch.upstream)
        try:
            await self._store.set_upstream(batch.id, None, next_at)
        except Exception:  # the lease then lapses on its own
            logger.warning("batch %s: its next step could not be scheduled", batch.id, exc_info=True)

    async def _submit(self, batch: Batch, target: ForwardTarget) -> None:
        if batch.status == "cancelling":  # cancelled before it was sent: nothing runs
            await self._store.finish_forwarded(batch.id, [], CANCELLED)
            return
        # A submission cut off before its id was kept (a gateway killed) left a batch there that
        # names ours: carried on, not sent twice (OpenAI's shape; Anthropic's keeps no metadata).
        upstream_id = await target.client.find(METADATA_KEY, batch.id)
        if upstream_id is None:
            lines = [(custom_id, {**body, "model": target.upstream_model})
                     for _, custom_id, body in await self._store.lines_of(batch.id)]
            upstream_id = await target.client.submit(lines, batch.endpoint, {METADATA_KEY: batch.id})
        logger.info("batch %s: submitted to %s as %s", batch.id, target.key, upstream_id)
        if not await self._store.set_upstream(batch.id, upstream_id, time.time() + self._poll_s):
            await target.client.cancel(upstream_id)  # cancelled or expired here meanwhile

    async def _poll(self, batch: Batch, target: ForwardTarget, upstream_id: str) -> None:
        if batch.status == "cancelling":
            await target.client.cancel(upstream_id)
        upstream = await target.client.poll(upstream_id)
        if upstream.ended:
            await self._read_back(batch, target, upstream)

    async def _read_back(self, batch: Batch, target: ForwardTarget, upstream: UpstreamBatch) -> None:
        outcomes = await target.client.results(upstream)
        results: list[tuple[int, LineOutcome]] = []
        for index, custom_id, body in await self._store.lines_of(batch.id):
            outcome = outcomes.get(custom_id)
            if outcome is None:
                continue
            response = outcome.response
            if response is not None and "model" in response:  # the name the line asked for, not the upstream's
                response = {**response, "model": body.get("model")}
            request_id = f"batch_req_{line_id_of(batch.id, index)}"
            results.append((index, dataclasses.replace(outcome, response=response, request_id=request_id)))
        await self._bill(batch, results)
        await self._store.finish_forwarded(batch.id, results, _rest(upstream))
        logger.info("batch %s: %s ended it (%s); %d results read back", batch.id, target.key, upstream.status,
                    len(results))

    async def _bill(self, batch: Batch, results: Sequence[tuple[int, LineOutcome]]) -> None:
        """One ledger row a line the upstream answered, at the batch tier's price, durable before
        the lines are written done (a row written twice is one: its id is the line's)."""
        gatekeeper = self._gatekeeper
        if gatekeeper is None:
            return
        # Revoked since: its rows are still its own.
        principal = principal_of(gatekeeper)(batch.key_id) or Principal(batch.key_id, "")
        calls = []
        for index, outcome in results:
            if outcome.status_code is None or outcome.request_id is None:
                continue  # never run there: nothing to bill
            call = Call(CallStart(batch.endpoint, principal, outcome.request_id, time.time(),
                                  batch_line=line_id_of(batch.id, index)))
            call.set_route(RouteChoice(batch.model or "", batch.model or ""))
            prompt, cached, completion, reasoning = usage_of(outcome.response)
            failed = outcome.outcome != "succeeded"
            call.end(CallOutcome(outcome.status_code, prompt, cached, completion, reasoning, completion,
                                 finish_reason=_finish_reason(outcome.response),
                                 error="upstream batch line failed" if failed else None))
            calls.append(gatekeeper.commit(call))
        await asyncio.gather(*calls)


def _rest(upstream: UpstreamBatch) -> LineOutcome:
    """How the lines the upstream's results leave out end."""
    if upstream.status == "cancelled":
        return CANCELLED
    if upstream.status == "expired":
        return EXPIRED
    message = "; ".join(upstream.errors) or f"The upstream's batch ended ({upstream.status}) without this request."
    return LineOutcome("failed", None, None, {"code": "upstream_batch_failed", "message": message})


def _finish_reason(body: JSONObject | None) -> str | None:
    if body is None:
        return None
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason")
    stop = body.get("stop_reason")
    return stop if isinstance(stop, str) else None


def build_forwarder(registry: Registry | None, router: Router, store: BatchStore,
                    gatekeeper: Gatekeeper | None) -> BatchForwarder | None:
    """The forwarder, hooked into the store's creation of batches, where some model has a
    batch_api replica; None where none has."""
    targets = forward_targets(registry, router) if registry is not None else {}
    if not targets:
        return None
    forwarder = BatchForwarder(store, targets, gatekeeper)
    store.forward_with(forwarder.choose)
    return forwarder
