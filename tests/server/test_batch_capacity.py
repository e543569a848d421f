"""batch_capacity (server/batch_lines.py): the batch runner's capacity is the router's room for
batch work, within the requests this server admits less the interactive ones in flight."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from tokenway.engine.stats import EngineStats
from tokenway.protocol.job import GenerationJob, ReplicaEvent
from tokenway.routing.balancer import Balancer, BalancerConfig
from tokenway.routing.router import Pool, Router
from tokenway.server.batch_lines import batch_capacity
from tokenway.server.services import Capacity

IDLE = EngineStats(0, 0, 100, 100, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, classes=None)


class LocalEngine:
    name, kind = "local", "engine"

    async def generate(self, job: GenerationJob) -> AsyncGenerator[ReplicaEvent, None]:
        raise AssertionError("not called")
        yield

    async def probe(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return IDLE

    async def aclose(self) -> None:
        pass


def router() -> Router:
    replica = LocalEngine()
    return Router({"m": Pool("m", {"local": replica}, Balancer(["local"], BalancerConfig(max_in_flight=64)))})


def test_the_room_is_the_routers_within_what_the_server_still_admits():
    capacity = Capacity(max_pending_requests=10)
    the_router = router()
    # An engine too old to count its classes: half its 64 slots, within the 10 the server admits.
    assert batch_capacity(capacity, the_router, 8)() == 10
    capacity.num_in_flight = 7  # interactive calls: the server admits 3 more
    assert batch_capacity(capacity, the_router, 8)() == 3
    the_router.pools["m"].name_to_num_batch["local"] = 5  # ... of which 5 are batch lines: 2 interactive
    assert batch_capacity(capacity, the_router, 8)() == 8
