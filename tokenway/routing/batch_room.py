"""How many batch lines a gateway may run at once: the room its replicas leave beside interactive
calls, as this gateway's router sees them (no I/O: read on every look the batch runner takes).

    per replica r of every pool (each once), that may take a call now (health.py):
        interactive(r)  this gateway's leases on r that are not batch work (Pool.name_to_num_batch)
        slots(r)        r's max_in_flight - interactive(r): the balancer's slots batch lines may hold
        r runs a tokenway engine that counts its classes (stats(): the local engine, a worker as
        of its last probe):
            room(r) = min(slots(r), seqs(r) - its engine's other classes running and waiting
                                            - the batch work other gateways run there)
            seqs(r): twice the local engine's max_num_seqs (below); a worker's max_in_flight (it
                     reports no max_num_seqs)
        else (an upstream, a worker not probed yet or too old to count classes: nothing here can
        put an interactive call ahead of a batch one there):
            room(r) = slots(r) // 2: the other half kept for interactive calls arriving later
    room = the sum: a total this gateway's batch lines may reach, its own running ones included

The local engine is kept a second wave deep: lines waiting in its queue are admitted the step
running ones end, where a line claimed only when one ends reaches the engine a claim, a
templating and a ledger row later (128 lines of one length ending in one step left the engine
at a fifth of its throughput for ~1 s, each time: bench/batch_bench.py). Waiting there costs
nothing: a waiting request holds no KV blocks, and
an engine admits a better class first, so a batch line never delays an interactive one there
whatever this lets run; the room keeps the queue's lines with the gateways whose replicas are
free (a line claimed here and waiting in a full engine is one another gateway could have run).
Other gateways' batch work on a shared worker is its engine's batch count less this gateway's
batch leases there: the count may be a probe old, so a line routed since makes theirs look
smaller for that long, never larger.
"""

from __future__ import annotations

from tokenway.engine.stats import EngineStats
from tokenway.routing.balancer import ReplicaView
from tokenway.routing.router import Router

LOCAL_QUEUE_DEPTH = 2  # the local engine's batch lines: running, and as many again waiting


def batch_room(router: Router, local_max_num_seqs: int | None = None) -> int:
    """The room, summed over the router's replicas. local_max_num_seqs: the local engine's
    (None: seqs(r) is its max_in_flight, as a worker's)."""
    room = 0
    seen: set[int] = set()
    for pool in router.unique_pools():
        for view in pool.balancer.views():
            replica = pool.replicas[view.name]
            if id(replica) in seen:
                continue
            seen.add(id(replica))
            if view.health is not None and view.health.unavailable_reason is not None:
                continue
            num_seqs = LOCAL_QUEUE_DEPTH * local_max_num_seqs \
                if replica.kind == "engine" and local_max_num_seqs is not None else None
            room += replica_room(view, pool.name_to_num_batch.get(view.name, 0), replica.stats(), num_seqs)
    return room


def replica_room(view: ReplicaView, num_batch: int, stats: EngineStats | None, num_seqs: int | None) -> int:
    """room(r) of the module's docstring. num_batch: this gateway's batch leases on r, of
    view.num_in_flight."""
    slots = view.max_in_flight - (view.num_in_flight - num_batch)
    classes = stats.classes if stats is not None else None
    if stats is None or classes is None:
        return max(0, slots // 2)
    num_batch_there = sum(c.num_running + c.num_waiting for c in classes if c.service_class == "batch")
    num_other_there = stats.num_running + stats.num_waiting - num_batch_there
    num_theirs = max(0, num_batch_there - num_batch)
    engine_room = (view.max_in_flight if num_seqs is None else num_seqs) - num_other_there - num_theirs
    return max(0, min(slots, engine_room))
