"""When a call needs a key (auth.py AuthPolicy) and what keeps auth on (KeyStore.has_held_keys):
under --auth auto a loopback server is open only while its key store has never held a key and no
admin key is set; revoking or outliving the last key leaves it closed, across a restart and for
every store on the same file; --auth on and --auth off are the operator's word."""

from __future__ import annotations

import time

import pytest

from tokenway.billing.ledger import Ledger
from tokenway.billing.pricing import PriceTable
from tokenway.gateway.auth import ANONYMOUS, AuthPolicy, is_loopback
from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.limits import InProcessLimiter
from tokenway.protocol.errors import AuthenticationError, FieldError


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True), ("127.0.0.2", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("gateway.internal", False),
])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


@pytest.mark.parametrize("mode, host, has_admin_key, has_held_keys, expected", [
    ("auto", "127.0.0.1", False, False, False),  # the only open case of auto
    ("auto", "127.0.0.1", False, True, True),  # a key has existed: on for good
    ("auto", "127.0.0.1", True, False, True),  # an admin key: the operator manages keys
    ("auto", "0.0.0.0", False, False, True),  # reachable from other machines
    ("on", "127.0.0.1", False, False, True),
    ("on", "localhost", False, True, True),
    ("off", "127.0.0.1", True, True, False),
    ("off", "0.0.0.0", False, True, False),
])
def test_the_policy(mode, host, has_admin_key, has_held_keys, expected):
    policy = AuthPolicy(mode, host, has_admin_key)
    assert policy.required(has_held_keys) is expected
    reason = policy.reason(has_held_keys)
    assert (f"--auth {mode}" in reason) is (mode != "auto")


@pytest.mark.parametrize("mode", ["", "Auto", "yes", False, None])
def test_an_unknown_mode_is_refused_naming_the_option(mode):
    with pytest.raises(FieldError) as refused:
        AuthPolicy(mode)  # pyright: ignore[reportArgumentType]
    assert refused.value.param == "auth" and "auto, on, off" in refused.value.reason


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "tokenway.db"


def test_a_store_has_held_keys_once_one_was_created_revoked_or_expired(db_path):
    with KeyStore(db_path) as store:
        assert not store.has_held_keys()
        _, info = store.create("leaked")
        assert store.has_held_keys()
        assert store.revoke(info.key_id)
        assert store.count_active() == 0 and store.has_held_keys()
    with KeyStore(db_path) as restarted:  # a fact of the table, not of one process
        assert restarted.count_active() == 0 and restarted.has_held_keys()


def test_an_expired_key_counts_too(tmp_path):
    with KeyStore(tmp_path / "expiring.db") as store:
        store.create("short-lived", expires_at=time.time() + 0.2)
        time.sleep(0.3)
        assert store.count_active() == 0 and store.has_held_keys()


def test_another_process_revoking_the_last_key_leaves_the_store_keyed(db_path):
    with KeyStore(db_path) as admin, KeyStore(db_path, refresh_seconds=0) as gateway:
        assert not gateway.has_held_keys()
        _, info = admin.create("ci")
        assert gateway.has_held_keys()
        admin.revoke(info.key_id)
        assert gateway.count_active() == 0 and gateway.has_held_keys()


def gatekeeper(keys: KeyStore, tmp_path, host: str = "127.0.0.1", **auth) -> Gatekeeper:
    return Gatekeeper(keys, InProcessLimiter(), Ledger(f"sqlite:///{tmp_path / 'ledger.db'}"),
                      PriceTable.from_config({}), Defaults(), host=host, **auth)


def refusal(gate: Gatekeeper, headers: dict[str, str]) -> AuthenticationError:
    with pytest.raises(AuthenticationError) as refused:
        gate.authenticate(headers)
    return refused.value


def test_revoking_the_last_key_keeps_the_gate_shut(db_path, tmp_path):
    with KeyStore(db_path) as keys:
        gate = gatekeeper(keys, tmp_path)
        assert gate.authenticate({}) is ANONYMOUS and not gate.auth_required
        assert gate.auth_summary.startswith("off (")
        secret, info = keys.create("leaked")
        bearer = {"authorization": f"Bearer {secret}"}
        assert gate.authenticate(bearer).key_id == info.key_id
        keys.revoke(info.key_id)
        assert gate.auth_required and gate.auth_summary.startswith("on (a key has existed")
        assert refusal(gate, bearer).code == "invalid_api_key"
        assert refusal(gate, {}).code == "missing_api_key"
    with KeyStore(db_path) as restarted:
        assert refusal(gatekeeper(restarted, tmp_path), {}).code == "missing_api_key"
        # Only the operator's explicit word opens it again.
        opened = gatekeeper(restarted, tmp_path, auth_mode="off")
        assert opened.authenticate({}) is ANONYMOUS and opened.authenticate(bearer) is ANONYMOUS
        assert opened.auth_summary == "off (--auth off)"


@pytest.mark.parametrize("auth, host", [({"auth_mode": "on"}, "127.0.0.1"), ({"has_admin_key": True}, "::1"),
                                        ({}, "0.0.0.0")])
def test_auth_on_before_any_key_says_how_to_make_one(db_path, tmp_path, auth, host):
    with KeyStore(db_path) as keys:
        gate = gatekeeper(keys, tmp_path, host, **auth)
        refused = refusal(gate, {"authorization": "Bearer anything"})
        assert refused.code == "no_api_keys" and "tokenway keys create" in refused.message
        assert gate.auth_summary.startswith("on (")
        secret, info = keys.create("first")
        assert gate.authenticate({"authorization": f"Bearer {secret}"}).key_id == info.key_id
