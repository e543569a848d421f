"""An agent CLI from npm, for the tests that drive one against a real server: installed into
this session's cache (never globally) at a pinned version, so that a new release cannot change
what a test checks unseen. Without npm, or without the registry, the test skips and says why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

INSTALL_TIMEOUT_S = 600


def npm_cli(package: str, version: str, binary: str) -> Path:
    """The path of `binary` from `package`@`version`, installed once a session (or a cache)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: the agent CLI ({package}) comes from npm")
    prefix = Path(os.environ["TOKENWAY_CACHE_DIR"]) / f"{package.replace('/', '+')}-{version}"
    path = prefix / "node_modules" / ".bin" / binary
    if not path.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        try:
            installed = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                                        f"{package}@{version}"], capture_output=True, text=True,
                                       timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm could not install {package}@{version} in {INSTALL_TIMEOUT_S} s")
        if installed.returncode != 0 or not path.exists():
            pytest.skip(f"npm could not install {package}@{version}: {installed.stderr[-500:]}")
    return path
