"""`tokenway serve` as an operator sees it: config file, tokenize endpoints, graceful stop."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tokenway.cli import load_config_file, main

from .conftest import Server

MODEL = "smollm2-135m-instruct"


def test_config_file_keys_and_errors(tmp_path):
    path = tmp_path / "tokenway.toml"
    path.write_text('port = 9001\nkv-cache-memory = "1GiB"\nserved_model_name = "small"\n')
    assert load_config_file(str(path)) == {"port": 9001, "kv_cache_memory": "1GiB", "served_model_name": ["small"],
                                           "registry": {}}
    # The registry's own tables go to routing/registry.py, the rest are serve's keys.
    path.write_text('port = 9001\nembeddings = false\n[[models]]\nname = "small"\n  [[models.replicas]]\n'
                    '  kind = "local"\n')
    assert load_config_file(str(path)) == {"port": 9001, "registry": {
        "embeddings": False, "models": [{"name": "small", "replicas": [{"kind": "local"}]}]}}
    path.write_text("colour = 'blue'\n")
    with pytest.raises(SystemExit, match="unknown key 'colour'"):
        load_config_file(str(path))


def test_a_missing_model_is_one_clear_line(capsys):
    assert main(["serve", "--model", "/no/such/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/model.gguf" in err and "Traceback" not in err


def test_tokenize_and_detokenize(server):
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 8192
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=10).json()
    assert chat["count"] > tokens["count"]  # the chat template adds its own tokens


def test_sigterm_lets_the_in_flight_stream_finish_then_exits_0(default_model_dir):
    server = Server("--graceful-shutdown-seconds", "30")
    lines: list[str] = []

    def consume() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 60,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    server.process.send_signal(signal.SIGTERM)  # mid-stream

    reader = threading.Thread(target=consume)
    reader.start()
    reader.join(120)
    assert server.stop() == 0
    assert "data: [DONE]" in lines
    finish = [line for line in lines if '"finish_reason":"length"' in line]
    assert finish, lines[-5:]
    assert "tokenway: stopped" in server.read_log()


def test_the_engine_process_killed_under_load_is_restarted(default_model_dir):
    """With --engine-process the engine runs in its own process: killed mid-stream, the stream
    ends with an error event (no hang), new calls get 503 + Retry-After and /ready says not
    ready until it is back, then the server serves again without being restarted itself."""
    server = Server("--engine-process")
    try:
        engine_pid = server.stats()["engine_pid"]
        assert engine_pid not in (None, server.process.pid)
        lines: list[str] = []
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    os.kill(engine_pid, signal.SIGKILL)
        errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[-1]["error"]["type"] == "internal_error", lines[-4:]
        assert "engine stopped" in errors[-1]["error"]["message"]

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 503

        deadline = time.monotonic() + 120
        while httpx.get(f"{server.base_url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, server.read_log()[-2000:]
            time.sleep(0.2)
        assert server.stats()["engine_restarts"] == 1 and server.stats()["engine_pid"] != engine_pid
        again = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] > 0
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]
