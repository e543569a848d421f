"""The gateway's app in process, on the session's fp32 engine, with a real SQLite ledger."""

from __future__ import annotations

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.engine.client import AsyncEngine
from tokenway.gateway.auth import KeyStore
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.limits import InProcessLimiter
from tokenway.server.app import create_app
from tokenway.server.serving import ServerConfig, ServerState


@pytest.fixture()
def app_and_ledger(llm, tmp_path):
    """(app, ledger); the key store is app.state.tokenway.gatekeeper.keys."""
    engine = AsyncEngine(core=llm.engine)
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    gatekeeper = Gatekeeper(KeyStore(tmp_path / "keys.db"), InProcessLimiter(), ledger, PriceTable.from_config({}),
                            Defaults(), host="127.0.0.1")
    name = "smollm2-135m-instruct"
    state = ServerState(engine=engine, config=ServerConfig(served_model_names=(name,)), model_names=(name,),
                        gatekeeper=gatekeeper)
    yield create_app(state), ledger
    engine.shutdown()
