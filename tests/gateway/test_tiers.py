"""The tier a call runs at: each API's field within a key's grant, a Batch API line, no gateway;
a key's tiers kept by the key store (an old store gains the column) and set by the keys CLI."""

import argparse
import sqlite3

import pytest

from tokenway.gateway.auth import Principal
from tokenway.gateway.gatekeeper import Defaults
from tokenway.gateway.keystore import KeyStore
from tokenway.gateway.tiers import (
    DEFAULT_GRANT,
    anthropic_ask,
    anthropic_tier,
    granted_tiers,
    openai_ask,
    openai_tier,
    resolve,
)
from tokenway.keys_cli import add_keys_parser, run_keys
from tokenway.protocol.errors import PermissionDeniedError

EVERY = ("priority", "default", "flex", "batch")


@pytest.mark.parametrize("asked, granted, tier", [
    (None, DEFAULT_GRANT, "default"),
    ("auto", DEFAULT_GRANT, "default"),
    ("auto", ("flex",), "flex"),  # a flex-only key's calls run at flex: never dearer than asked
    ("auto", ("priority", "default"), "default"),
    ("default", DEFAULT_GRANT, "default"),
    ("flex", DEFAULT_GRANT, "flex"),
    ("priority", ("priority",), "priority"),
    ("scale", EVERY, "priority"),
])
def test_openai_tiers_within_the_grant(asked, granted, tier):
    assert resolve(openai_ask(asked), granted, None) == tier


@pytest.mark.parametrize("asked, granted, tier", [
    (None, DEFAULT_GRANT, "default"),  # no field is Anthropic's auto: priority only where granted
    (None, EVERY, "priority"),
    ("auto", ("priority",), "priority"),
    ("standard_only", EVERY, "default"),
])
def test_anthropic_tiers_within_the_grant(asked, granted, tier):
    assert resolve(anthropic_ask(asked), granted, None) == tier


@pytest.mark.parametrize("ask, granted, named", [
    (openai_ask("priority"), DEFAULT_GRANT, "service tier priority; its tiers: default, flex, batch."),
    (openai_ask("flex"), ("default",), "service tier flex; its tiers: default."),
    (openai_ask("scale"), DEFAULT_GRANT, "service tier scale (priority); its tiers"),
    (openai_ask("auto"), ("priority", "batch"), "service tier auto (default or flex); its tiers: priority, batch."),
    (anthropic_ask("standard_only"), ("priority",), "service tier standard_only (default); its tiers: priority."),
])
def test_a_tier_the_key_lacks_is_a_403_naming_it_and_the_keys_tiers(ask, granted, named):
    with pytest.raises(PermissionDeniedError) as refused:
        resolve(ask, granted, None)
    error = refused.value
    assert (error.status, error.code, error.param) == (403, "service_tier_not_allowed", "service_tier")
    assert named in error.message


def test_a_batch_line_runs_as_batch_whatever_its_body_asks():
    assert resolve(openai_ask("priority"), DEFAULT_GRANT, "abc0l7") == "batch"
    assert resolve(anthropic_ask(None), EVERY, "abc0l7") == "batch"
    assert resolve(openai_ask("priority"), None, "abc0l7") == "batch"
    with pytest.raises(PermissionDeniedError, match=r"batch \(a Batch API line\); its tiers: default") as refused:
        resolve(openai_ask("default"), ("default",), "abc0l7")
    assert refused.value.param is None  # no field of the line's body asked it


def test_without_a_gateway_a_tier_named_runs_as_asked_and_auto_is_default():
    assert [resolve(openai_ask(t), None, None) for t in ("priority", "flex", "scale", "auto", None)] == [
        "priority", "flex", "priority", "default", "default"]
    assert resolve(anthropic_ask(None), None, None) == "default"


def test_a_key_without_tiers_has_the_servers_grant():
    assert granted_tiers(Principal("k_1", "a"), DEFAULT_GRANT) == ("default", "flex", "batch")
    assert granted_tiers(Principal("k_1", "a"), ("default",)) == ("default",)
    assert granted_tiers(Principal("k_1", "a", service_tiers=("priority",)), DEFAULT_GRANT) == ("priority",)


def test_each_api_says_the_tier_in_its_own_words():
    assert [openai_tier(c) for c in EVERY] == ["priority", "default", "flex", "default"]
    assert [anthropic_tier(c) for c in EVERY] == ["priority", "standard", "standard", "batch"]


@pytest.mark.parametrize("tiers", [(), ("gold",), ("flex", "flex"), ["flex"]])
def test_a_principal_refuses_tiers_that_are_none(tiers):
    with pytest.raises(ValueError, match="service_tiers"):
        Principal("k_1", "a", service_tiers=tiers)


def test_the_servers_grant_is_checked_as_the_config_names_it():
    assert Defaults().service_tiers == DEFAULT_GRANT
    with pytest.raises(ValueError, match="^default_service_tiers: .*'gold'"):
        Defaults(service_tiers=("default", "gold"))


def test_the_key_store_keeps_a_keys_tiers(tmp_path):
    with KeyStore(tmp_path / "keys.db") as store:
        secret, info = store.create("app", service_tiers=["default", "priority"])
        _, plain = store.create("plain")
        assert info.service_tiers == ("default", "priority") and plain.service_tiers is None
        assert info.to_dict()["service_tiers"] == ["default", "priority"]
        assert store.authenticate(secret).service_tiers == ("default", "priority")
        with pytest.raises(ValueError, match="service_tiers"):
            store.create("bad", service_tiers=("platinum",))


def test_a_key_store_from_before_tiers_gains_the_column(tmp_path):
    path = tmp_path / "keys.db"
    with sqlite3.connect(path) as conn:  # api_keys as it was before service tiers
        conn.execute("""CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, secret_sha256 BLOB NOT NULL,
            hint TEXT NOT NULL, name TEXT NOT NULL, models TEXT, rpm INTEGER, tpm INTEGER, tpd INTEGER,
            max_concurrent INTEGER, max_tokens INTEGER, budget_usd REAL, expires_at REAL, created_at REAL NOT NULL,
            revoked_at REAL, last_used_at REAL, safety TEXT)""")
        conn.execute("INSERT INTO api_keys (key_id, secret_sha256, hint, name, created_at) "
                     "VALUES ('k_00000001', x'00', 'tw-k_00000001-…abcd', 'old', 1.0)")
    with KeyStore(path) as store:
        assert store.get("k_00000001").service_tiers is None
        _, info = store.create("new", service_tiers=("flex",))
        assert store.get(info.key_id).service_tiers == ("flex",)


def test_the_keys_cli_sets_and_lists_a_keys_tiers(tmp_path, capsys):
    def keys(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="tokenway")
        add_keys_parser(parser.add_subparsers(dest="command", required=True))
        return run_keys(parser.parse_args(["keys", *argv]))

    db = str(tmp_path / "tokenway.db")
    assert keys("create", "--db", db, "--name", "app", "--tiers", "default, flex,priority") == 0
    secret = capsys.readouterr().out.strip()
    with KeyStore(db) as store:
        assert store.authenticate(secret).service_tiers == ("default", "flex", "priority")
    assert keys("list", "--db", db) == 0
    assert "default,flex,priority" in capsys.readouterr().out
    assert keys("create", "--db", db, "--name", "bad", "--tiers", "gold") == 2
    assert "service_tiers" in capsys.readouterr().err
