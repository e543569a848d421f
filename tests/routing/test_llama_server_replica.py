"""A real external engine as a replica: llama.cpp's `llama-server` (built by
../shared/bench/build_peers.sh) serving the default model's GGUF, behind a gateway that loads no
model. The official openai and anthropic SDKs, unchanged, get chat, streams and usage, and
the usage llama-server reports is what the ledger bills. Skipped, saying why, where no
llama-server binary exists (set TOKENWAY_LLAMA_SERVER to one)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tokenway.models.loader import _default_gguf

from ..e2e.conftest import Server, free_port

CONFIG = """
[[models]]
name = "llama"
context_window = 2048
  [[models.replicas]]
  kind = "openai"
  name = "llama-server"
  url = "http://127.0.0.1:{port}/v1"
  model = "smollm2"
"""


def llama_server_binary() -> str | None:
    peers = Path(os.environ.get("PEERS_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "tokenway-peers")
    for candidate in (os.environ.get("TOKENWAY_LLAMA_SERVER"), peers / "bin" / "llama-server",
                      shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    binary = llama_server_binary()
    if binary is None:
        pytest.skip("no llama-server binary: build it with ../shared/bench/build_peers.sh, or set "
                    "TOKENWAY_LLAMA_SERVER")
    gguf = _default_gguf()  # the default model's own file, as tokenway serve loads it
    directory = tmp_path_factory.mktemp("llama")
    port = free_port()
    # --no-repack: this build's AMX-repacked Q4_1 path crashes on CPUs with AMX (../shared/bench/README.md)
    with open(directory / "llama-server.log", "w") as log:  # the child holds its own copy of the file
        llama = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "2048",
                                  "-t", "1", "--no-repack"], stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        deadline = time.monotonic() + 120
        while True:
            assert llama.poll() is None, (directory / "llama-server.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become ready"
            time.sleep(0.2)
        config = directory / "gateway.toml"
        config.write_text(CONFIG.format(port=port))
        server = Server("--config", str(config), "--no-embeddings")
        yield server
    finally:
        if server is not None:
            server.stop()
        llama.send_signal(signal.SIGTERM)
        try:
            llama.wait(10)
        except subprocess.TimeoutExpired:
            llama.kill()


def test_llama_server_serves_chat_and_streams_and_its_usage_is_billed(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
        temperature=0)
    completion = raw.parse()
    assert completion.model == "llama" and completion.choices[0].message.content
    usage = completion.usage
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 16
    row = gateway.ledger_row(raw.headers["x-request-id"])
    assert (row["prompt_tokens"], row["completion_tokens"], row["status"]) == \
        (usage.prompt_tokens, usage.completion_tokens, 200)

    stream = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Count from one to five."}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["stop"], ["length"])

    message = anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0).messages.create(
        model="llama", max_tokens=16, messages=[{"role": "user", "content": "Say hello."}])
    assert message.content[0].text and message.usage.output_tokens > 0
    route = httpx.get(f"{gateway.base_url}/v1/traces/{raw.headers['x-request-id']}", timeout=10).json()["route"]
    assert (route["pool"], route["replica"]) == ("llama", "llama-server")
