"""Building the native kernels survives a builder that was killed mid-build: torch's lock file
it left behind does not make every later start wait forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenway import native
from tokenway.config import default_cache_dir

REPO = Path(__file__).resolve().parents[1]


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    if native.disabled() or native.load("quant") is None:
        pytest.skip("no native build on this machine")
    name = native.build_directory("quant").name  # the same key wherever the cache is
    built = next((d for d in (default_cache_dir() / "native" / name, Path.home() / ".cache/tokenway/native" / name)
                  if (d / "tokenway_quant.so").is_file()), None)
    if built is None:
        pytest.skip("the quant kernels were built in no cache this test can see")
    copy = tmp_path / "native" / name
    with native._build_lock(built):  # not while another process builds it
        shutil.copytree(built, copy, ignore=shutil.ignore_patterns(".tokenway-build.lock"))
    # Built already: the load below compiles nothing.
    (copy / "lock").touch()  # what torch's FileBaton leaves when its builder is killed
    env = {**os.environ, "TOKENWAY_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    script = "from tokenway import native; print(native.load('quant') is not None)"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
    assert not (copy / "lock").exists()
    assert "left by a build that was killed" in done.stderr
