"""The gateway's app in process, on the session's fp32 engine, with a real SQLite ledger."""

from __future__ import annotations

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.engine.client import AsyncEngine
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.observability.observer import Observer
from tokenway.server.app import create_app
from tokenway.server.services import ModelCatalog, ServerConfig, Services, local_router


def gateway_services(engine: AsyncEngine, tmp_path, model_names: tuple[str, ...] = ("smollm2-135m-instruct",),
                     admin_key: str | None = None, observe: bool = False) -> Services:
    """A server's services on `engine` with a real key store and SQLite ledger under tmp_path
    (and an Observer with observe)."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    gatekeeper = Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger, PriceTable.from_config({}),
                            Defaults(), host="127.0.0.1")
    settings = ServerConfig(served_model_names=model_names, admin_key=admin_key)
    return Services.build(settings, ModelCatalog.local(engine.frontend, model_names),
                          local_router(engine, model_names, settings.max_pending_requests), engine=engine,
                          gatekeeper=gatekeeper, observer_for=Observer if observe else None)


@pytest.fixture()
def app_and_ledger(llm, tmp_path):
    """(app, ledger); the key store is app.state.services.gatekeeper.keys."""
    engine = AsyncEngine(core=llm.engine)
    services = gateway_services(engine, tmp_path)
    yield create_app(services), services.gatekeeper.ledger
    engine.shutdown()
