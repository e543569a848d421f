"""The key store on a real PostgreSQL (scripts/postgres.sh): the same rules as on SQLite, and
what sharing one database brings: stores that stand for gateways (each with a refresh interval
of an hour, so only the change feed can tell them of a change) see one another's new keys,
revocations and rotations; one whose feed connection is cut catches up when it is back; one
whose database is gone keeps authenticating from its cache. And keys move between stores with
export and import, hashes only."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from tokenway.gateway.auth import AuthPolicy, hash_secret
from tokenway.gateway.keystore import ImportConflict, KeyStore, KeyStoreUnavailable, StoredKey, UnknownKeyError
from tokenway.safety.screen import SafetyPolicy

psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL key store needs psycopg 3")

HOUR = 3600.0  # a refresh interval no test waits out


def eventually(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Polls until condition() holds; the timeout only keeps a broken feed from hanging the test."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


@pytest.fixture
def open_store(postgres_database) -> Iterator[Callable[..., KeyStore]]:
    stores: list[KeyStore] = []

    def open_store(refresh_seconds: float = HOUR) -> KeyStore:
        stores.append(KeyStore(postgres_database, refresh_seconds=refresh_seconds))
        return stores[-1]

    yield open_store
    for store in stores:
        store.close()


def test_a_keys_lifecycle_on_postgresql(open_store):
    store = open_store()
    policy = SafetyPolicy(input="redact", output="flag")
    secret, info = store.create("ci", models=["m1"], rpm=60, tpd=10_000_000_000, budget_usd=2.5,
                                expires_at=time.time() + 60, safety=policy, service_tiers=["default", "flex"],
                                response_cache=False)
    principal = store.authenticate(secret)
    assert principal is not None and (principal.key_id, principal.models, principal.tpd, principal.budget_usd,
                                      principal.safety, principal.service_tiers, principal.response_cache) == (
        info.key_id, ("m1",), 10_000_000_000, 2.5, policy, ("default", "flex"), False)
    assert store.get(info.key_id) == info and store.list() == [info] and store.count_active() == 1
    assert store.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None

    new_secret = store.rotate(info.key_id)
    assert store.authenticate(secret) is None and store.authenticate(new_secret) == principal
    assert store.revoke(info.key_id) and not store.revoke(info.key_id)
    assert store.authenticate(new_secret) is None and store.count_active() == 0
    assert store.list(include_revoked=False) == [] and store.get(info.key_id).status(time.time()) == "revoked"
    with pytest.raises(ValueError, match="revoked"):
        store.rotate(info.key_id)
    with pytest.raises(UnknownKeyError):
        store.rotate("k_00000000")


def test_every_store_on_the_database_sees_new_keys_revocations_and_rotations(open_store):
    gateway_a, gateway_b = open_store(), open_store()
    secret, info = gateway_a.create("shared")
    eventually(lambda: gateway_b.authenticate(secret) is not None, "the new key on the other store")

    rotated = gateway_b.rotate(info.key_id)
    eventually(lambda: gateway_a.authenticate(secret) is None, "the rotation on the other store")
    assert gateway_a.authenticate(rotated) is not None

    gateway_b.revoke(info.key_id)
    assert gateway_b.authenticate(rotated) is None  # at once on the store that revoked it
    eventually(lambda: gateway_a.authenticate(rotated) is None, "the revocation on the other store")
    assert gateway_a.count_active() == 0


def test_a_revoked_last_key_keeps_auth_on_for_every_gateway_on_the_database(open_store):
    gateway_a, gateway_b = open_store(), open_store()
    policy = AuthPolicy("auto", "127.0.0.1")
    assert not gateway_a.has_held_keys() and not policy.required(gateway_b.has_held_keys())
    _, info = gateway_a.create("leaked")
    eventually(gateway_b.has_held_keys, "the first key on the other store")
    gateway_b.revoke(info.key_id)
    eventually(lambda: gateway_a.count_active() == 0, "the revocation on the other store")
    assert gateway_a.has_held_keys() and policy.required(gateway_a.has_held_keys())
    restarted = open_store()  # a gateway started later reads the same fact
    assert restarted.count_active() == 0 and policy.required(restarted.has_held_keys())


def test_concurrent_creates_on_two_stores_all_land(open_store):
    from concurrent.futures import ThreadPoolExecutor

    gateway_a, gateway_b = open_store(), open_store()
    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(lambda i: (gateway_a, gateway_b)[i % 2].create(f"key-{i}"), range(40)))
    assert len({info.key_id for _, info in created}) == 40
    eventually(lambda: all(store.authenticate(secret) is not None for store in (gateway_a, gateway_b)
                           for secret, _ in created), "every key on both stores")


def test_a_store_whose_feed_connection_was_cut_catches_up(open_store, postgres_database):
    watcher, writer = open_store(), open_store()
    eventually(lambda: listeners(postgres_database) == 2, "both feeds listening")
    with psycopg.connect(postgres_database, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN %%'"
                      " AND datname = current_database()")
    secret, _ = writer.create("while-the-feed-was-down")
    eventually(lambda: watcher.authenticate(secret) is not None, "the key made while its feed was cut")


def test_without_its_database_a_store_authenticates_from_its_cache_and_refuses_administration(
        open_store, postgres_database):
    store = open_store()
    secret, info = store.create("cached")
    name = postgres_database.rsplit("/", 1)[1]
    admin_url = postgres_database.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        try:
            assert store.authenticate(secret) is not None
            with pytest.raises(KeyStoreUnavailable) as refused:
                store.create("no-database")
            assert refused.value.retry_after_s > 0
            assert store.authenticate(secret) is not None and store.count_active() == 1
        finally:
            admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    store.revoke(info.key_id)  # the next call opens a new connection
    assert store.authenticate(secret) is None


def test_export_from_sqlite_and_import_into_postgresql_is_idempotent_and_refuses_conflicts(open_store, tmp_path):
    with KeyStore(tmp_path / "keys.db") as old:
        live_secret, live = old.create("live", rpm=5, safety=SafetyPolicy(input="block"))
        _, gone = old.create("gone")
        old.revoke(gone.key_id)
        assert old.authenticate(live_secret) is not None  # a last use, which import does not compare
        exported = [StoredKey.from_dict(key.to_dict()) for key in old.export()]
    assert all(live_secret not in str(key.to_dict()) for key in exported)
    assert next(k for k in exported if k.info.key_id == live.key_id).secret_sha256 == hash_secret(live_secret)

    new = open_store()
    result = new.import_keys(exported)
    assert (result.num_added, result.num_unchanged) == (2, 0)
    assert new.authenticate(live_secret) is not None and new.authenticate(live_secret).rpm == 5
    assert [info.status(time.time()) for info in new.list()] == ["active", "revoked"]
    assert new.import_keys(exported) == type(result)(0, 2)

    other_secret, _ = new.create("made-on-the-new-store")
    changed = replace(exported[0], info=replace(exported[0].info, rpm=6))
    fresh = replace(exported[0], info=replace(exported[0].info, key_id="k_0000abcd", hint="tw-k_0000abcd-…x"))
    with pytest.raises(ImportConflict, match=exported[0].info.key_id):
        new.import_keys([fresh, changed])
    assert new.get("k_0000abcd") is None  # nothing added: all or none
    assert new.authenticate(other_secret) is not None and len(new.list()) == 3


@pytest.mark.parametrize("line, field", [
    ({"secret_sha256": "ab"}, "secret_sha256"),
    ({"rpm": 0}, "rpm"),
    ({"models": "m1"}, "models"),
    ({"service_tiers": ["gold"]}, "service_tiers"),
    ({"created_at": "yesterday"}, "created_at"),
    ({"owner": "x"}, "owner"),
])
def test_an_exported_line_is_checked_as_a_new_key_is(tmp_path, line, field):
    with KeyStore(tmp_path / "keys.db") as store:
        store.create("x")
        data = store.export()[0].to_dict()
    with pytest.raises(ValueError) as error:
        StoredKey.from_dict({**data, **line})
    assert getattr(error.value, "param", None) == field


def listeners(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %%'"
                           " AND datname = current_database()").fetchone()
    assert row is not None
    return row[0]
