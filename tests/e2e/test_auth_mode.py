"""Auth that was on stays on, on a real loopback server: a key created and revoked (by the CLI, or
by the admin API) leaves its own calls and calls without a key refused with 401, after the
server's 2 s refresh, across a restart and under --workers 2; only `--auth off` opens the server
again, and /ready says which mode holds. `auth = "on"` in the config closes a server that has
no key yet."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import REPO, Server

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret-for-auth-mode-tests"
REFRESH_S = 2.0  # the SQLite key store's poll interval (keystore.py DEFAULT_REFRESH_SECONDS)


def keys_cli(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenway.cli", "keys", *args, "--db", str(db)],
                          capture_output=True, text=True, cwd=REPO, check=True)


def chat(server: Server, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


def models(server: Server, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).status_code


def ready(server: Server) -> tuple[str, str]:
    body = httpx.get(f"{server.base_url}/ready", timeout=10).json()
    return body["auth"], body["auth_mode"]


def seconds_until(predicate, timeout: float = 3 * REFRESH_S) -> float:
    """How long predicate() took to hold; fails the test once timeout passes (a bound far above
    the 2 s refresh, only so that a broken server cannot hang the test)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "never held"
        time.sleep(0.05)
    return time.monotonic() - start


def assert_shut(server: Server, secret: str) -> None:
    """The revoked key's calls and keyless calls are 401, and stay so past a refresh."""
    time.sleep(REFRESH_S + 0.2)  # the refresh that, before, turned auth off with no live key left
    for key in (secret, None):
        refused = chat(server, key)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "authentication_error"
    assert ready(server) == ("on", "auto")


@pytest.fixture
def db(tmp_path) -> Path:
    return tmp_path / "auth-mode.db"


def test_a_key_created_and_revoked_by_the_cli_leaves_the_server_shut(default_model_dir, db):
    server = Server("--no-embeddings", db=db)
    try:
        assert chat(server, None).status_code == 200 and ready(server) == ("off", "auto")  # no key yet
        secret = keys_cli(db, "create", "--name", "leaked").stdout.strip()
        print(f"auth on after the CLI's create: {seconds_until(lambda: models(server, None) == 401):.2f} s")
        assert chat(server, secret).status_code == 200
        key_id = secret.split("-")[1]  # tw-<key_id>-<random>
        assert "no live key is left" in keys_cli(db, "revoke", key_id).stderr
        print(f"the revoked key refused after: {seconds_until(lambda: models(server, secret) == 401):.2f} s")
        assert_shut(server, secret)
        assert "auth off (no key has existed" in server.read_log()
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]

    # Restarted, as two workers: each reads the fact from the key store.
    workers = Server("--no-embeddings", "--workers", "2", db=db)
    try:
        seconds_until(lambda: workers.read_log().count(") ready") >= 2, timeout=120)
        assert {chat(workers, key).status_code for _ in range(4) for key in (secret, None)} == {401}
        assert ready(workers) == ("on", "auto")
        assert workers.read_log().count("auth on (a key has existed in the key store") == 2
    finally:
        assert workers.stop() == 0, workers.read_log()[-3000:]

    opened = Server("--no-embeddings", "--auth", "off", db=db)
    try:
        assert chat(opened, None).status_code == 200 and chat(opened, secret).status_code == 200
        assert ready(opened) == ("off", "off") and "auth off (--auth off)" in opened.read_log()
    finally:
        assert opened.stop() == 0, opened.read_log()[-3000:]


def test_a_key_created_and_revoked_by_the_admin_api_leaves_the_server_shut(default_model_dir, db):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    server = Server("--no-embeddings", "--admin-key-file", str(write(db.parent / "admin.key", ADMIN)), db=db)
    try:
        # An admin key means keys are managed here: auth is on before the first one.
        refused = chat(server, None)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "no_api_keys"
        assert ready(server) == ("on", "auto")
        created = httpx.post(f"{server.base_url}/admin/keys", headers=admin, json={"name": "leaked"}, timeout=10)
        assert created.status_code == 201
        secret, key_id = created.json()["key"], created.json()["key_id"]
        assert chat(server, secret).status_code == 200
        assert httpx.post(f"{server.base_url}/admin/keys/{key_id}/revoke", headers=admin,
                          timeout=10).status_code == 200
        assert chat(server, secret).status_code == 401  # the gateway that revoked it: at once
        assert_shut(server, secret)
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]
    # Restarted without the admin key: the revoked key alone keeps auth on.
    restarted = Server("--no-embeddings", db=db)
    try:
        assert_shut(restarted, secret)
    finally:
        assert restarted.stop() == 0, restarted.read_log()[-3000:]


def test_auth_on_in_the_config_closes_a_server_with_no_key_yet(default_model_dir, db):
    config = write(db.parent / "tokenway.toml", 'auth = "on"\n')
    server = Server("--no-embeddings", "--config", str(config), db=db)
    try:
        refused = chat(server, None)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "no_api_keys"
        assert ready(server) == ("on", "on") and "auth on (--auth on)" in server.read_log()
        assert "no live API key exists" in server.read_log()
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
