import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tokenway.gateway.keystore import KeyStore
from tokenway.keys_cli import add_keys_parser, default_db_path, parse_expires, run_keys


def keys(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tokenway")
    add_keys_parser(parser.add_subparsers(dest="command", required=True))
    return run_keys(parser.parse_args(["keys", *argv]))


@pytest.fixture
def db(tmp_path) -> str:
    return str(tmp_path / "tokenway.db")


def test_cli_round_trip(db, capsys):
    assert keys("create", "--db", db, "--name", "ci", "--models", "m1, m2", "--rpm", "60", "--tpm", "1000",
                "--max-concurrent", "2", "--max-tokens", "256", "--budget-usd", "1.5", "--expires", "30d") == 0
    out, err = capsys.readouterr()
    secret = out.strip()
    assert "\n" not in secret and "shown only this once" in err
    with KeyStore(db) as store:
        principal = store.authenticate(secret)
        assert (principal.models, principal.rpm, principal.tpm, principal.tpd, principal.max_concurrent,
                principal.max_tokens, principal.budget_usd) == (("m1", "m2"), 60, 1000, None, 2, 256, 1.5)
    key_id = principal.key_id

    assert keys("--db", db, "list") == 0
    out, _ = capsys.readouterr()
    assert key_id in out and "m1,m2" in out and "active" in out and secret not in out
    assert secret.split("-", 2)[2][:-4] not in out

    assert keys("rotate", "--db", db, key_id) == 0
    out, err = capsys.readouterr()
    new_secret = out.strip()
    assert new_secret != secret and "shown only this once" in err

    assert keys("list", "--db", db, "--json") == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["key_id"] == key_id and listed["hint"].endswith(new_secret[-4:])

    assert keys("revoke", "--db", db, key_id) == 0
    assert keys("revoke", "--db", db, key_id) == 0  # twice is fine
    assert "already revoked" in capsys.readouterr().err
    with KeyStore(db) as store:
        assert store.authenticate(secret) is None and store.authenticate(new_secret) is None
    assert keys("list", "--db", db) == 0
    out = capsys.readouterr().out
    assert "revoked" in out and secret not in out and new_secret not in out


def test_a_key_made_in_or_out_of_the_response_cache(db, capsys):
    for flags, setting in ((["--response-cache"], True), (["--no-response-cache"], False), ([], None)):
        assert keys("create", "--db", db, "--name", "c", *flags) == 0
        secret = capsys.readouterr().out.strip()
        with KeyStore(db) as store:
            assert store.authenticate(secret).response_cache is setting


def test_cli_errors_are_one_line_with_exit_codes(db, capsys):
    assert keys("revoke", "--db", db, "k_00000000") == 1
    assert keys("rotate", "--db", db, "k_00000000") == 1
    assert capsys.readouterr().err.count("no API key") == 2
    assert keys("create", "--db", db, "--name", "ci", "--rpm", "0") == 2
    assert "rpm" in capsys.readouterr().err
    assert keys("create", "--db", db, "--name", "ci", "--expires", "soon") == 2
    assert "--expires" in capsys.readouterr().err
    with KeyStore(db) as store:
        assert store.list() == []


def test_list_of_an_empty_store_says_how_to_make_a_key(db, capsys):
    assert keys("list", "--db", db) == 0
    assert "tokenway keys create" in capsys.readouterr().out


def test_default_db_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENWAY_DATA_DIR", str(tmp_path / "data"))
    assert default_db_path() == tmp_path / "data" / "tokenway.db"
    monkeypatch.delenv("TOKENWAY_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db_path() == tmp_path / ".local" / "share" / "tokenway" / "tokenway.db"


def test_the_default_db_is_used_without_db(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TOKENWAY_DATA_DIR", str(tmp_path / "new-dir"))
    assert keys("create", "--name", "ci") == 0
    assert Path(tmp_path / "new-dir" / "tokenway.db").exists()


def test_parse_expires():
    now = 1_000_000.0
    assert parse_expires("never", now) is None
    assert parse_expires("30d", now) == now + 30 * 86400
    assert parse_expires("12h", now) == now + 12 * 3600
    assert parse_expires("2w", now) == now + 14 * 86400
    assert parse_expires("2026-12-31", now) == datetime(2026, 12, 31, tzinfo=UTC).timestamp()
    assert parse_expires("2026-12-31T12:00:00+02:00", now) == datetime(2026, 12, 31, 10, tzinfo=UTC).timestamp()
    for bad in ("0d", "tomorrow", "30x", ""):
        with pytest.raises(ValueError, match="--expires"):
            parse_expires(bad, now)


def test_export_then_import_moves_keys_between_stores_once(db, tmp_path, capsys):
    assert keys("create", "--db", db, "--name", "moved", "--rpm", "7") == 0
    secret = capsys.readouterr().out.strip()
    assert keys("--db", db, "export") == 0
    exported = capsys.readouterr().out
    assert secret not in exported and json.loads(exported)["rpm"] == 7
    dump = tmp_path / "keys.jsonl"
    dump.write_text(exported)
    target = f"sqlite:///{tmp_path / 'other.db'}"

    assert keys("--store-url", target, "import", str(dump)) == 0
    assert "imported 1 API key(s)" in capsys.readouterr().err
    assert keys("--store-url", target, "import", str(dump)) == 0  # again: nothing changes
    assert "imported 0 API key(s)" in (err := capsys.readouterr().err) and "1 were there already" in err
    with KeyStore(tmp_path / "other.db") as store:
        principal = store.authenticate(secret)
        assert principal is not None and principal.rpm == 7 and len(store.list()) == 1

    dump.write_text(exported.replace('"rpm": 7', '"rpm": 8'))
    assert keys("--store-url", target, "import", str(dump)) == 2
    assert "another secret or other values" in capsys.readouterr().err
    assert keys("--store-url", target, "--db", db, "list") == 2


def test_a_postgresql_store_without_psycopg_names_the_extra(monkeypatch):
    import importlib.util

    from tokenway.gateway.extras import missing_package

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("psycopg", "redis")
                        else real_find_spec(name, *a))
    assert missing_package("--store-url", "postgresql://db/keys") == (
        "--store-url postgresql://... needs the psycopg package, not installed: pip install 'tokenway[scale]'")
    assert "redis package" in (missing_package("--limits-url", "redis://127.0.0.1:6379") or "")
    assert missing_package("--limits-url", "memory") is None and missing_package("--store-url", None) is None
    with pytest.raises(RuntimeError, match=r"tokenway\[scale\]"):
        KeyStore("postgresql://db/keys")


def test_revoking_the_last_live_key_says_auth_stays_on(db, capsys):
    for name in ("a", "b"):
        assert keys("create", "--db", db, "--name", name) == 0
    with KeyStore(db) as store:
        key_ids = [info.key_id for info in store.list()]
    capsys.readouterr()
    assert keys("revoke", "--db", db, key_ids[0]) == 0
    assert "no live key is left" not in capsys.readouterr().err  # one is still live
    assert keys("revoke", "--db", db, key_ids[1]) == 0
    err = capsys.readouterr().err
    assert "no live key is left: a server on this store refuses every call" in err and "--auth off" in err
    with KeyStore(db) as store:
        assert store.count_active() == 0 and store.has_held_keys()
