"""What the routes share, built once: the catalog's answers for a request's `model`, the
capacity counter's 503, and /engine/stats as the engine's counts, then the server's."""

from __future__ import annotations

import dataclasses

import pytest

from tokenway.engine.client import AsyncEngine
from tokenway.engine.stats import EngineStats
from tokenway.protocol.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from tokenway.routing.router import Router
from tokenway.server.services import Capacity, ModelCatalog, ServerConfig, Services, local_router
from tokenway.server.stats import ServerStats

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
    assert read() == ServerStats(None, 5, {})  # a gateway only: no engine counts
    assert read().to_dict() == {"num_pending_http": 5, "replicas": {}}
    assert services.capacity.max_pending_requests == 7


def test_the_payload_is_the_engines_counts_in_their_order_then_the_servers(llm):
    engine = AsyncEngine(core=llm.engine)
    try:
        stats = ServerStats.read(engine, local_router(engine, ("m",), 4), 2)
        assert stats.engine is not None
        payload = stats.to_dict()
        # A thread engine: no engine_pid or engine_restarts.
        counts = [field.name for field in dataclasses.fields(EngineStats)][:-2]
        assert list(payload) == [*counts, "num_pending_http", "replicas"] and payload["num_pending_http"] == 2
        assert {key: payload[key] for key in counts} == stats.engine.to_dict()
        assert payload["kv_blocks_total"] == llm.engine.kv_manager.num_blocks
        assert stats.with_pool_totals({"local"})["replicas"] == {
            "local": {"num_replicas": 1, "num_available": 1, "num_in_flight": 0, "num_outstanding_tokens": 0}}
        assert stats.with_pool_totals(set())["replicas"] == {}
    finally:
        engine.shutdown()
