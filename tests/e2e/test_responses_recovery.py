"""A server killed while a background response runs, restarted on the same database: the response
it left in progress is stored failed, with the error saying why, instead of staying in progress
forever (its lease, 1 s here, passed while no server held it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from .conftest import Server

MODEL = "smollm2-135m-instruct"


def test_a_background_response_left_running_by_a_killed_server_is_failed_on_restart(tmp_path, default_model_dir):
    config = tmp_path / "serve.toml"
    config.write_text("responses_lease_seconds = 1.0\n")
    db = Path(os.environ["TOKENWAY_DATA_DIR"]) / f"recovery-{os.getpid()}.db"
    args = ("--config", str(config), "--no-embeddings")
    server = Server(*args, db=db)
    try:
        queued = httpx.post(f"{server.base_url}/v1/responses", timeout=30, json={
            "model": MODEL, "input": "Count from 1 to 1000, one number a line.", "background": True,
            "max_output_tokens": 4000, "temperature": 0}).json()
        path = f"{server.base_url}/v1/responses/{queued['id']}"
        deadline = time.monotonic() + 60
        while httpx.get(path, timeout=10).json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.process.kill()  # no shutdown: nothing stores how it ended
        server.process.wait()
    finally:
        server.stop()

    restarted = Server(*args, db=db)
    try:
        path = f"{restarted.base_url}/v1/responses/{queued['id']}"
        deadline = time.monotonic() + 60
        while (stored := httpx.get(path, timeout=10).json())["status"] == "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert stored["status"] == "failed" and stored["error"]["code"] == "server_error"
        assert "stopped before it finished" in stored["error"]["message"]
        continued = httpx.post(f"{restarted.base_url}/v1/responses", timeout=60, json={
            "model": MODEL, "previous_response_id": queued["id"], "input": "Go on.", "max_output_tokens": 4})
        assert continued.status_code == 200  # a failed response is final: its conversation goes on
    finally:
        assert restarted.stop() == 0, restarted.read_log()[-3000:]
