"""A real tokenway server on loopback, started the way a user starts it."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """extra_args as on the command line; with --ssl-certfile, base_url is https and `verify`
    is the certificate to trust."""

    def __init__(self, *extra_args: str, db: Path | None = None, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        # Each server its own keys and ledger unless a test shares one on purpose.
        self.db = db or Path(os.environ["TOKENWAY_DATA_DIR"]) / f"server-{self.port}.db"
        self.db.parent.mkdir(parents=True, exist_ok=True)
        tls = "--ssl-certfile" in extra_args
        self.verify = ssl.create_default_context(cafile=extra_args[extra_args.index("--ssl-certfile") + 1]) if tls \
            else True
        self.base_url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TOKENWAY_CACHE_DIR", "/tmp")) / f"server-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")  # noqa: SIM115  (held for the server's life: stop() closes it)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokenway.cli", "serve", "--port", str(self.port),
             # float32: greedy output is then the same whatever else is in the batch or the
             # prefix cache, so the tests can compare texts exactly.
             "--kv-cache-memory", "512MiB", "--dtype", "float32", "--db", str(self.db), *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become ready:\n{self.read_log()}")

    def read_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/engine/stats", timeout=5).json()

    def ledger_row(self, request_id: str, timeout: float = 10) -> dict:
        """The call's row in this server's SQLite ledger, once committed ({} if it never is)."""
        deadline = time.monotonic() + timeout
        while True:
            with sqlite3.connect(self.db) as conn:
                conn.row_factory = sqlite3.Row
                row = conn.execute("SELECT * FROM usage_ledger WHERE request_id = ?", (request_id,)).fetchone()
            if row is not None or time.monotonic() > deadline:
                return dict(row) if row is not None else {}
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def server(default_model_dir):
    server = Server()
    yield server
    assert server.stop() == 0, server.read_log()[-3000:]


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built(model_cache_dir) -> None:
    """Every native extension built into this run's cache before any server starts: a server that
    builds one itself (the experts kernel, first met by the first MoE model's server) can spend
    the minutes of a cold 2-core build inside its readiness deadline. Builds are under a file
    lock, so pytest-xdist's workers build each once."""
    from tokenway import native

    for source in sorted(native.SOURCE_DIR.glob("*.cpp")):
        native.load(source.stem)
