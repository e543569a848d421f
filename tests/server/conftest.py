"""The gateway's app in process, on the session's fp32 engine, with a real SQLite ledger."""

from __future__ import annotations

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.engine.client import AsyncEngine
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.server.app import create_app
from tokenway.server.serving import ServerConfig, ServerState


def gateway_state(engine: AsyncEngine, tmp_path, model_names: tuple[str, ...] = ("smollm2-135m-instruct",),
                  admin_key: str | None = None) -> ServerState:
    """A server's state on `engine` with a real key store and SQLite ledger under tmp_path."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    gatekeeper = Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger, PriceTable.from_config({}),
                            Defaults(), host="127.0.0.1")
    return ServerState(engine=engine, config=ServerConfig(served_model_names=model_names, admin_key=admin_key),
                       model_names=model_names, gatekeeper=gatekeeper)


@pytest.fixture()
def app_and_ledger(llm, tmp_path):
    """(app, ledger); the key store is app.state.tokenway.gatekeeper.keys."""
    engine = AsyncEngine(core=llm.engine)
    state = gateway_state(engine, tmp_path)
    yield create_app(state), state.gatekeeper.ledger
    engine.shutdown()
