"""What the routes share, built once: the catalog's answers for a request's `model`, the
capacity counter's 503, and /engine/stats typed at the engine's boundary."""

from __future__ import annotations

import dataclasses

import pytest

from tokenway.engine.client import AsyncEngine
from tokenway.protocol.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from tokenway.routing.router import Router
from tokenway.server.services import Capacity, ModelCatalog, ServerConfig, Services, local_router
from tokenway.server.stats import EngineStats, ServerStats

CATALOG = ModelCatalog(("chat-a", "chat-b"), context_windows={"chat-a": 4096, "chat-b": 8192},
                       aliases={"a": "chat-a"}, embedding_model_names=("embed",))


def test_the_catalog_resolves_served_names_and_aliases_and_refuses_the_rest():
    assert CATALOG.resolve("chat-b") == "chat-b"
    assert CATALOG.resolve("a") == "chat-a"
    assert CATALOG.resolve("embed", kind="embeddings") == "embed"
    assert CATALOG.max_model_len("chat-b") == 8192  # untemplated: the configured window
    assert CATALOG.frontend() is None and CATALOG.frontend("chat-a") is None
    with pytest.raises(NotFoundError) as missing:
        CATALOG.resolve("chat-c")
    assert missing.value.code == "model_not_found"
    with pytest.raises(InvalidRequestError) as other_kind:
        CATALOG.resolve("embed")
    assert other_kind.value.code == "model_not_supported" and "embeddings model" in other_kind.value.message
    with pytest.raises(InvalidRequestError, match="is a chat model"):
        CATALOG.resolve("a", kind="embeddings")


def test_capacity_refuses_past_its_limit_with_retry_after_and_takes_nothing():
    capacity = Capacity(3)
    capacity.take(2)
    with pytest.raises(ServiceUnavailableError) as full:
        capacity.take(2)
    assert full.value.headers["retry-after"] == "1" and "2 requests in flight" in full.value.message
    assert capacity.num_in_flight == 2
    capacity.take(1)
    capacity.release(3)
    assert capacity.num_in_flight == 0


def test_services_are_frozen_and_share_one_capacity_with_the_stats_reader():
    observed = []
    services = Services.build(ServerConfig(max_pending_requests=7), CATALOG, Router({}),
                              observer_for=lambda stats: observed.append(stats))  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        services.router = Router({})  # type: ignore[misc]
    services.capacity.take(5)
    [read] = observed
    assert read() == {"num_pending_http": 5, "replicas": {}}  # a gateway only: no engine counts
    assert services.capacity.max_pending_requests == 7


def test_engine_stats_keep_every_count_the_engine_publishes_in_its_order(llm):
    engine = AsyncEngine(core=llm.engine)
    try:
        snapshot = engine.stats()
        stats = ServerStats.read(engine, local_router(engine, ("m",), 4), 2)
        assert stats.engine is not None
        # The engine's own dict, typed here: a count it adds (or drops) must be added here too.
        assert stats.engine.to_dict() == snapshot and list(stats.engine.to_dict()) == list(snapshot)
        payload = stats.to_dict()
        assert list(payload)[-2:] == ["num_pending_http", "replicas"] and payload["num_pending_http"] == 2
        assert stats.with_pool_totals({"local"})["replicas"] == {
            "local": {"num_replicas": 1, "num_available": 1, "num_in_flight": 0, "num_outstanding_tokens": 0}}
        assert stats.with_pool_totals(set())["replicas"] == {}
    finally:
        engine.shutdown()


def test_a_process_engine_adds_its_pid_and_restarts():
    published = {field.name: 0 for field in dataclasses.fields(EngineStats)
                 if field.name not in ("engine_pid", "engine_restarts")}
    stats = EngineStats.from_snapshot({**published, "engine_pid": 4242, "engine_restarts": 1})
    assert stats.to_dict() == {**published, "engine_pid": 4242, "engine_restarts": 1}
    assert "engine_pid" not in EngineStats.from_snapshot(published).to_dict()
    with pytest.raises(KeyError):
        EngineStats.from_snapshot({"num_running": 1})
