import logging
import time

import pytest

from tokenway.gateway.auth import (
    ANONYMOUS,
    Principal,
    authorize_model,
    key_id_of,
    principal_for,
    secret_from_headers,
)
from tokenway.gateway.keystore import KeyStore, UnknownKeyError
from tokenway.protocol.errors import AuthenticationError, PermissionDeniedError


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "tokenway.db"


@pytest.fixture
def store(db_path):
    with KeyStore(db_path) as store:
        yield store


def test_create_returns_the_secret_once_and_authenticate_gives_the_keys_limits(store):
    secret, info = store.create("ci", models=["m1", "m2"], rpm=60, tpm=10_000, tpd=1_000_000, max_concurrent=4,
                                max_tokens=512, budget_usd=2.5, expires_at=time.time() + 3600)
    assert secret.startswith(f"tw-{info.key_id}-") and len(secret) >= len(f"tw-{info.key_id}-") + 32
    assert key_id_of(secret) == info.key_id
    assert info.hint == f"tw-{info.key_id}-…{secret[-4:]}"
    assert info.created_at <= time.time() and info.revoked_at is None

    principal = store.authenticate(secret)
    assert principal == Principal(key_id=info.key_id, name="ci", models=("m1", "m2"), rpm=60, tpm=10_000,
                                  tpd=1_000_000, max_concurrent=4, max_tokens=512, budget_usd=2.5,
                                  expires_at=info.expires_at)
    assert principal.may_use("m1") and not principal.may_use("m3")
    assert store.list() == [info]
    assert store.count_active() == 1


def test_secrets_are_unique_and_only_their_hash_is_stored(store, db_path):
    secret_a, info_a = store.create("a")
    secret_b, info_b = store.create("b")
    assert info_a.key_id != info_b.key_id and secret_a != secret_b
    raw = db_path.read_bytes() + (db_path.parent / "tokenway.db-wal").read_bytes()
    assert secret_a.encode() not in raw and secret_a.split("-", 2)[2][:20].encode() not in raw


@pytest.mark.parametrize("mangle", [
    lambda s: s[:-1] + ("A" if s[-1] != "A" else "B"),  # right id, wrong random part
    lambda s: s + "x",
    lambda s: s.replace("tw-k_", "tw-k_0", 1),  # malformed id
    lambda s: "tw-k_00000000-" + s.rsplit("-", 1)[1],  # unknown id
    lambda s: "",
    lambda s: s.upper(),
    lambda s: s + "a" * 300,
])
def test_a_wrong_or_malformed_secret_is_refused(store, mangle):
    secret, _ = store.create("ci")
    assert store.authenticate(mangle(secret)) is None
    assert store.authenticate(secret) is not None


def test_a_revoked_key_fails_at_once_and_stays_listed(store):
    secret, info = store.create("ci")
    other_secret, _ = store.create("other")
    assert store.revoke(info.key_id) is True
    assert store.authenticate(secret) is None
    assert store.authenticate(other_secret) is not None
    assert store.revoke(info.key_id) is False  # already revoked
    assert store.revoke("k_00000000") is False  # unknown
    (listed,) = [i for i in store.list() if i.key_id == info.key_id]
    assert listed.revoked_at is not None and listed.status(time.time()) == "revoked"
    assert [i.name for i in store.list(include_revoked=False)] == ["other"]
    assert store.count_active() == 1


def test_an_expired_key_fails_and_is_not_counted_active(store):
    secret, info = store.create("short", expires_at=time.time() + 0.3)
    assert store.authenticate(secret) is not None and store.count_active() == 1
    time.sleep(0.35)
    assert store.authenticate(secret) is None  # exact: expiry is checked per call, not per refresh
    assert store.count_active() == 0
    assert store.get(info.key_id).status(time.time()) == "expired"


def test_a_keys_principal_by_id_is_the_one_it_authenticates_as_while_it_is_active(store):
    secret, info = store.create("batches", rpm=7, service_tiers=("default", "batch"))
    _, short = store.create("short", expires_at=time.time() + 0.3)
    assert store.principal(info.key_id) == store.authenticate(secret)
    assert store.principal(info.key_id).rpm == 7 and store.principal("k_00000000") is None
    store.revoke(info.key_id)
    assert store.principal(info.key_id) is None
    time.sleep(0.35)
    assert store.principal(short.key_id) is None


def test_rotate_keeps_id_and_limits_and_only_the_new_secret_works(store):
    old_secret, info = store.create("ci", models=["m1"], rpm=5)
    new_secret = store.rotate(info.key_id)
    assert key_id_of(new_secret) == info.key_id and new_secret != old_secret
    assert store.authenticate(old_secret) is None
    principal = store.authenticate(new_secret)
    assert (principal.key_id, principal.models, principal.rpm) == (info.key_id, ("m1",), 5)
    assert store.get(info.key_id).hint.endswith(new_secret[-4:])


def test_rotate_refuses_unknown_and_revoked_keys(store):
    _, info = store.create("ci")
    with pytest.raises(UnknownKeyError):
        store.rotate("k_00000000")
    store.revoke(info.key_id)
    with pytest.raises(ValueError, match="revoked"):
        store.rotate(info.key_id)


def test_another_store_on_the_same_file_sees_changes_within_its_refresh_interval(store, db_path):
    refresh_seconds = 0.2
    secret, info = store.create("ci")
    with KeyStore(db_path, refresh_seconds=refresh_seconds) as gateway:
        assert gateway.authenticate(secret) is not None

        def seconds_until(condition) -> float:
            start = time.monotonic()
            while not condition():
                assert time.monotonic() - start < 2.0, "change never seen"
                time.sleep(0.01)
            return time.monotonic() - start

        new_secret = store.rotate(info.key_id)
        assert seconds_until(lambda: gateway.authenticate(new_secret) is not None) <= refresh_seconds + 0.1
        assert gateway.authenticate(secret) is None

        store.revoke(info.key_id)
        assert seconds_until(lambda: gateway.authenticate(new_secret) is None) <= refresh_seconds + 0.1

        later_secret, _ = store.create("later")
        assert seconds_until(lambda: gateway.authenticate(later_secret) is not None) <= refresh_seconds + 0.1


def test_unrelated_writes_to_the_shared_file_do_not_disturb_the_cache(store, db_path):
    # The usage ledger shares the file; its writes must neither break nor invalidate auth.
    import sqlite3

    secret, _ = store.create("ci")
    other = sqlite3.connect(db_path)
    other.execute("CREATE TABLE usage (id INTEGER PRIMARY KEY, n INTEGER)")
    other.executemany("INSERT INTO usage (n) VALUES (?)", [(i,) for i in range(100)])
    other.commit()
    other.close()
    with KeyStore(db_path, refresh_seconds=0.0) as gateway:
        assert gateway.authenticate(secret) is not None


@pytest.mark.parametrize("kwargs, field", [
    ({"name": ""}, "name"),
    ({"name": "x" * 201}, "name"),
    ({"name": "ci", "models": []}, "models"),
    ({"name": "ci", "models": ["m", ""]}, "models"),
    ({"name": "ci", "rpm": 0}, "rpm"),
    ({"name": "ci", "tpm": True}, "tpm"),
    ({"name": "ci", "max_concurrent": 1.5}, "max_concurrent"),
    ({"name": "ci", "budget_usd": -1.0}, "budget_usd"),
    ({"name": "ci", "budget_usd": float("nan")}, "budget_usd"),
    ({"name": "ci", "expires_at": 1.0}, "expires_at"),
])
def test_create_rejects_bad_fields_with_value_error(store, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        store.create(**kwargs)
    assert store.list() == []


def test_last_used_is_noted_in_memory_and_written_by_flush(store):
    secret, info = store.create("ci")
    before = time.time()
    store.authenticate(secret)
    assert store.get(info.key_id).last_used_at is None
    store.flush_last_used()
    assert store.get(info.key_id).last_used_at >= before


def test_no_secret_reaches_repr_listing_or_logs(store, caplog):
    caplog.set_level(logging.DEBUG)
    secret, info = store.create("ci", rpm=1)
    rotated = store.rotate(info.key_id)
    for attempt in (secret, rotated, rotated + "x"):
        store.authenticate(attempt)
        with pytest.raises(AuthenticationError) as excinfo:
            principal_for({"authorization": f"Bearer {attempt}x"}, store)
        assert attempt not in excinfo.value.message
    store.revoke(info.key_id)
    store.flush_last_used()
    texts = [caplog.text, repr(info), repr(store.list()), repr(store.get(info.key_id)),
             repr(store.authenticate(rotated)), str([i.to_dict() for i in store.list()])]
    assert "api key" in caplog.text  # the lifecycle was logged, just not the secrets
    for text in texts:
        for leaked in (secret, rotated):
            # The random part (which may itself hold "-"), less the 4 chars a hint shows.
            assert leaked not in text and leaked.split("-", 2)[2][:-4] not in text


def test_secret_from_headers_accepts_bearer_and_x_api_key():
    assert secret_from_headers({"authorization": "Bearer tw-k_1-abc"}) == "tw-k_1-abc"
    assert secret_from_headers({"authorization": "bearer  tw-k_1-abc "}) == "tw-k_1-abc"
    assert secret_from_headers({"x-api-key": "tw-k_1-abc"}) == "tw-k_1-abc"
    assert secret_from_headers({"authorization": "Basic abc"}) is None
    assert secret_from_headers({"authorization": "Bearer "}) is None
    assert secret_from_headers({}) is None


def test_principal_for_gives_401_for_missing_or_bad_keys_and_anonymous_when_auth_is_off(store):
    secret, info = store.create("ci")
    assert principal_for({}, None) is ANONYMOUS
    assert principal_for({"x-api-key": secret}, store).key_id == info.key_id
    with pytest.raises(AuthenticationError) as missing:
        principal_for({}, store)
    assert missing.value.status == 401 and missing.value.code == "missing_api_key"
    with pytest.raises(AuthenticationError) as wrong:
        principal_for({"authorization": "Bearer tw-k_00000000-nope"}, store)
    assert wrong.value.code == "invalid_api_key"


def test_authorize_model_gives_403_for_a_model_the_key_may_not_use():
    principal = Principal(key_id="k_00000001", name="ci", models=("m1",))
    authorize_model(principal, "m1")
    authorize_model(ANONYMOUS, "anything")
    with pytest.raises(PermissionDeniedError) as excinfo:
        authorize_model(principal, "m2")
    assert excinfo.value.status == 403 and excinfo.value.param == "model"


def test_count_active_follows_other_processes_within_the_refresh_interval(store, db_path):
    with KeyStore(db_path, refresh_seconds=0.1) as gateway:
        assert gateway.count_active() == 0
        _, info = store.create("ci")
        time.sleep(0.15)
        assert gateway.count_active() == 1
        store.revoke(info.key_id)
        time.sleep(0.15)
        assert gateway.count_active() == 0
