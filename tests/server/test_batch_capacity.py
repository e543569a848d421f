"""batch_capacity (server/batch_lines.py): the batch runner's capacity is the router's room for
batch work, within the batch lines this server admits; batch lines and interactive calls count
apart, so lines deep in an engine's queue never turn an interactive call away."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from tokenway.engine.stats import EngineStats
from tokenway.protocol.errors import ServiceUnavailableError
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


def test_the_room_is_the_routers_within_the_batch_lines_the_server_admits():
    capacity = Capacity(max_pending_requests=10)
    the_router = router()
    # An engine too old to count its classes: half its 64 slots, within the 10 lines the server admits.
    assert batch_capacity(capacity, the_router, 8)() == 10
    capacity.take(7)  # interactive calls take no batch line's room, nor lines theirs
    assert batch_capacity(capacity, the_router, 8)() == 10
    capacity.take(10, batch=True)
    capacity.take(3)
    with pytest.raises(ServiceUnavailableError):
        capacity.take(1, batch=True)
    with pytest.raises(ServiceUnavailableError):
        capacity.take(1)
    capacity.release(10, batch=True)
    assert (capacity.num_in_flight, capacity.num_batch) == (10, 0)
