"""What an attacker or a careless client sends cannot break the ledger, the next start, or
another database's ledger; TLS and the admin key's sources work as documented."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess

import httpx
import openai
import pytest

from .conftest import Server, free_port

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"


def schema_nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# The reproducers, each with the status it must get and the param it must name.
REPRODUCERS = [
    ("lone surrogate in model", CHAT, b'{"model":"\\ud800","messages":[{"role":"user","content":"hi"}],"max_tokens":2}',
     400, "model"),
    ("lone surrogate in content", CHAT,
     b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"hi \\udc00"}],"max_tokens":2}',
     400, "messages[0].content"),
    ("lone surrogate in prompt", "/v1/completions",
     b'{"model":"' + MODEL.encode() + b'","prompt":"hi \\ud800","max_tokens":2}', 400, "prompt"),
    ("5000-digit max_tokens", CHAT, b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"hi"}],'
     b'"max_tokens":' + b"9" * 5000 + b"}", 400, None),
    ("JSON nested 10000 deep", CHAT, b"[" * 10_000 + b"]" * 10_000, 400, None),
    ("schema nested 200 deep", CHAT, json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_nested(200)}}}
    ).encode(), 400, "response_format"),
    ("min_tokens over max_tokens", CHAT, json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 100_000}
    ).encode(), 400, "min_tokens"),
    ("1000 stop_sequences", "/v1/messages", json.dumps({
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "stop_sequences": ["a"] * 1000}).encode(), 400, None),
    ("7 MB prompt", CHAT, json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hello world " * 600_000}]}).encode(), 400, "messages"),
]


def ledger_rows(db) -> dict[str, dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return {r["request_id"]: dict(r) for r in conn.execute("SELECT * FROM usage_ledger")}


def test_every_reproducer_is_a_4xx_with_a_row_and_the_server_starts_again_on_that_database(default_model_dir,
                                                                                       tmp_path):
    server = Server(db=tmp_path / "poisoned.db")
    request_ids = []
    try:
        for name, path, body, status, param in REPRODUCERS:
            response = httpx.post(server.base_url + path, content=body, timeout=60,
                                  headers={"content-type": "application/json"})
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            if param is not None and path != "/v1/messages":
                assert error["param"].startswith(param), (name, error)
            request_ids.append(response.headers.get("x-request-id") or response.headers["request-id"])
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        server.process.send_signal(signal.SIGKILL)  # no clean shutdown: whatever is journaled stays
        server.process.wait()
    finally:
        server.stop()
    restarted = Server(db=tmp_path / "poisoned.db")
    try:
        rows = ledger_rows(tmp_path / "poisoned.db")
        assert set(request_ids) <= set(rows), "every call has its row"
        assert all(rows[i]["status"] == 400 for i in request_ids)
        surrogate_row = rows[request_ids[0]]
        assert "invalid unicode" in surrogate_row["error"]
        ok = httpx.post(restarted.base_url + CHAT, timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        assert restarted.stop() == 0


def test_two_databases_in_one_folder_killed_and_restarted_swapped_keep_their_own_rows(default_model_dir, tmp_path):
    a_db, b_db = tmp_path / "a.db", tmp_path / "b.db"
    a_port, b_port = free_port(), free_port()
    servers = {"a": Server(db=a_db, port=a_port), "b": Server(db=b_db, port=b_port)}
    # Hold each database's write lock so the rows of the calls below stay in the journals
    # (a response's last byte waits for its journal line, not for the commit), then kill -9.
    locks = []
    for db in (a_db, b_db):
        lock = sqlite3.connect(db, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        locks.append(lock)
    request_ids: dict[str, set[str]] = {"a": set(), "b": set()}
    try:
        for name, server in servers.items():
            for i in range(3):
                response = httpx.post(server.base_url + CHAT, timeout=60, json={
                    "model": MODEL, "messages": [{"role": "user", "content": f"{name} {i}"}], "max_tokens": 2})
                assert response.status_code == 200
                request_ids[name].add(response.json()["id"])
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
    finally:
        for lock in locks:
            lock.execute("ROLLBACK")
            lock.close()
        for server in servers.values():
            server.stop()
    assert all(not ledger_rows(db) for db in (a_db, b_db)), "the rows were meant to be in the journals"
    # Restarted the other way round: a on b's port, b on a's.
    restarted = [Server(db=a_db, port=b_port), Server(db=b_db, port=a_port)]
    try:
        assert set(ledger_rows(a_db)) == request_ids["a"]
        assert set(ledger_rows(b_db)) == request_ids["b"]
    finally:
        for server in restarted:
            assert server.stop() == 0


def test_ambiguous_framing_is_refused_and_the_connection_closed(server):
    body = b'{"model": "x"}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               + hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):  # the server closes: recv returns b"" instead of blocking
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["code"] == "ambiguous_framing"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_tls_with_the_openai_sdk_trusting_a_self_signed_certificate(default_model_dir, certificate):
    cert, key = certificate
    server = Server("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        assert "https://127.0.0.1" in server.read_log()
        with httpx.Client(verify=server.verify) as http_client:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", http_client=http_client)
            replies = [client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                                      messages=[{"role": "user", "content": "Say hi."}])
                       for _ in range(2)]
            assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
            stream = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, stream=True,
                                                    messages=[{"role": "user", "content": "Say hi."}])
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
                replies[0].choices[0].message.content
        with pytest.raises(httpx.ConnectError):  # an untrusting client refuses it
            httpx.get(server.base_url + "/health", timeout=5)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # and plain HTTP gets no answer
            httpx.get(server.base_url.replace("https", "http") + "/health", timeout=5)
    finally:
        assert server.stop() == 0


def test_the_admin_key_from_a_file_and_a_warning_for_one_on_the_command_line(default_model_dir, tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text("from-a-file-secret\n")
    from_file = Server("--admin-key-file", str(key_file))
    try:
        assert httpx.get(from_file.base_url + "/admin/keys", timeout=5,
                         headers={"Authorization": "Bearer from-a-file-secret"}).status_code == 200
        assert "WARNING" not in from_file.read_log()
    finally:
        assert from_file.stop() == 0
    on_command_line = Server("--admin-key", "visible-in-ps")
    try:
        assert "--admin-key is visible to every user" in on_command_line.read_log()
    finally:
        assert on_command_line.stop() == 0
