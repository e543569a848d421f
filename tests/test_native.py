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

REPO = Path(__file__).resolve().parents[1]


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    if native.disabled() or native.load("quant") is None:
        pytest.skip("no native build on this machine")
    built = native.build_directory("quant")
    copy = tmp_path / "native" / built.name
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
