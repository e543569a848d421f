"""batch_room (routing/batch_room.py): the batch lines a gateway may run at once, from its
replicas' loads: the local engine's sequences less its interactive work, a shared worker's less
the batch work other gateways run there, half an upstream's free slots; nothing on a replica that
is down; each replica once however many names its pool has. Router.generate counts the batch
calls it runs per replica, and forgets each as it ends."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from tokenway.engine.stats import ClassStats, EngineStats
from tokenway.protocol.job import SERVICE_CLASSES, ChoiceDelta, GenerationJob, ServiceClass, Usage
from tokenway.protocol.sampling import SamplingParams
from tokenway.routing.balancer import Balancer, BalancerConfig
from tokenway.routing.batch_room import batch_room
from tokenway.routing.health import CircuitBreaker, ReplicaHealth
from tokenway.routing.router import Pool, Router

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def engine_stats(num_batch: int = 0, num_interactive: int = 0, num_waiting: int = 0) -> EngineStats:
    """An engine running num_batch batch and num_interactive default requests, num_waiting more
    default ones waiting."""
    def counts(service_class: ServiceClass) -> tuple[int, int]:
        return {"batch": (num_batch, 0), "default": (num_interactive, num_waiting)}.get(service_class, (0, 0))

    classes = tuple(ClassStats(c, *counts(c), 0, 0, 0) for c in SERVICE_CLASSES)
    return EngineStats(num_batch + num_interactive, num_waiting, 100, 100, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0,
                       classes=classes)


class Replica:
    """Runs each call until the test opens the gate; reports what `engine` says (None: an upstream)."""

    def __init__(self, name: str, kind: str, engine: EngineStats | None = None) -> None:
        self.name, self.kind, self.engine = name, kind, engine
        self.gate = asyncio.Event()

    async def generate(self, job):
        yield ChoiceDelta(0, text="x")
        await self.gate.wait()
        yield ChoiceDelta(0, text="", finish_reason="stop")
        yield Usage(1, 1)

    async def probe(self) -> bool:
        return True

    def stats(self) -> EngineStats | None:
        return self.engine

    async def aclose(self) -> None:
        pass


def pool(name: str, *replicas: Replica, max_in_flight: int = 10) -> Pool:
    healths = {r.name: ReplicaHealth(r.name, CircuitBreaker()) for r in replicas}
    balancer = Balancer([r.name for r in replicas], BalancerConfig(max_in_flight=max_in_flight),
                        name_to_health=healths)
    return Pool(name, {r.name: r for r in replicas}, balancer, healths)


def job(model: str, service_class: ServiceClass) -> GenerationJob:
    return GenerationJob("cmpl-1", model, "completion", SamplingParams(max_tokens=8), prompt="hi",
                         prompt_token_ids=(1, 2, 3), service_class=service_class)


async def started(router: Router, model: str, service_classes: list[ServiceClass]) -> list[asyncio.Task[None]]:
    """Calls of these classes, each running (its first event out, its lease held) until its gate opens."""
    first_events: list[asyncio.Event] = []

    async def call(service_class: ServiceClass, first: asyncio.Event) -> None:
        async with aclosing(router.generate(job(model, service_class), lambda choice: None)) as events:
            async for _ in events:
                first.set()

    tasks = []
    for service_class in service_classes:
        first_events.append(first := asyncio.Event())
        tasks.append(asyncio.create_task(call(service_class, first)))
    await asyncio.gather(*(first.wait() for first in first_events))
    return tasks


async def test_the_local_engine_leaves_two_waves_of_its_sequences_less_its_interactive_work():
    local = Replica("local", "engine", engine_stats())
    router = Router({"m": pool("m", local, max_in_flight=256)})
    # 8 sequences running and 8 waiting: the second wave is admitted the step the first ends.
    assert batch_room(router, local_max_num_seqs=8) == 16
    tasks = await started(router, "m", ["batch", "batch", "batch", "default", "default"])
    assert router.pools["m"].name_to_num_batch == {"local": 3}
    # The engine has not counted the new calls yet, then has: the room is the same either way (a
    # total: the runner subtracts its own lines), less the interactive work once the engine has it.
    assert batch_room(router, local_max_num_seqs=8) == 16
    local.engine = engine_stats(num_batch=3, num_interactive=2, num_waiting=1)
    assert batch_room(router, local_max_num_seqs=8) == 16 - 3
    local.engine = engine_stats(num_batch=3, num_interactive=12, num_waiting=6)
    assert batch_room(router, local_max_num_seqs=8) == 0  # never below none
    local.gate.set()
    await asyncio.gather(*tasks)
    assert router.pools["m"].name_to_num_batch == {"local": 0}


async def test_a_shared_worker_leaves_less_the_batch_work_of_other_gateways():
    worker = Replica("w", "worker", engine_stats(num_batch=6, num_interactive=1))
    router = Router({"m": pool("m", worker, max_in_flight=10)})
    # 6 batch requests there, none of them ours: 10 - 1 interactive - 6 theirs.
    assert batch_room(router) == 3
    tasks = await started(router, "m", ["batch", "batch"])
    assert batch_room(router) == 5  # two of the six are ours: room for them
    worker.gate.set()
    await asyncio.gather(*tasks)


async def test_an_upstream_gives_half_its_slots_free_of_interactive_calls():
    upstream = Replica("u", "openai")
    router = Router({"m": pool("m", upstream, max_in_flight=10)})
    assert batch_room(router) == 5
    classes: list[ServiceClass] = ["default", "default", "default", "default", "batch", "batch"]
    tasks = await started(router, "m", classes)
    assert batch_room(router) == (10 - 4) // 2  # the batch calls' own slots stay theirs
    upstream.gate.set()
    await asyncio.gather(*tasks)


async def test_a_replica_down_has_no_room_and_each_replica_counts_once():
    local = Replica("local", "engine", engine_stats())
    upstream = Replica("u", "openai")
    worker = Replica("w", "worker", engine_stats(num_interactive=4))
    chat = pool("chat", local, worker, max_in_flight=10)
    router = Router({"chat": chat, "chat-alias": chat, "other": pool("other", upstream, max_in_flight=10)})
    assert batch_room(router, local_max_num_seqs=4) == 2 * 4 + (10 - 4) + 5  # the local engine two waves deep
    chat.healths["w"].record_probe(False, "connection refused")
    assert batch_room(router, local_max_num_seqs=4) == 2 * 4 + 5
