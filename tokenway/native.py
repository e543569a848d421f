"""tokenway's own CPU kernels (C++, OpenMP), compiled for the CPU they run on.

Each extension is built once per machine with torch.utils.cpp_extension (g++ and ninja) under
`$TOKENWAY_CACHE_DIR/native/<name>-<key>`, where the key covers the sources, torch's version
and this CPU's instruction-set flags: a cache carried to a CPU without AVX512 is never loaded
there, it is rebuilt for it. `-march=native` lets the compiler use what this CPU has.

Nothing here is required: when no compiler is present or a build fails, `load` returns None,
says why once in the log, and the model runs on torch's own operators.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tokenway.native")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _key(sources: list[Path]) -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    flags = sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx", "fma", "f16c", "sse", "bmi")))
    digest.update(" ".join(flags).encode())
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def disabled() -> bool:
    return os.environ.get("TOKENWAY_NATIVE", "1").lower() in ("0", "false", "no", "off")


def load(name: str) -> ModuleType | None:
    """The operators csrc/<name>.cpp registers with `TORCH_LIBRARY(tokenway_<name>, m)`, as
    `torch.ops.tokenway_<name>`, or None (no compiler, a failed build, or TOKENWAY_NATIVE=0)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        _loaded[name] = module = None if disabled() else _build(name)
        return module


def build_directory(name: str) -> Path:
    """Where extension `name` is built for this CPU, these sources and this torch."""
    from tokenway.models.loader import default_cache_dir

    sources = [SOURCE_DIR / f"{name}.cpp"]
    headers = sorted(SOURCE_DIR.glob("*.h"))  # shared by the kernels: a change rebuilds them all
    return default_cache_dir() / "native" / f"{name}-{_key(sources + headers)}"


def _build(name: str) -> ModuleType | None:
    if shutil.which("g++") is None or shutil.which("ninja") is None:
        logger.warning("tokenway: no g++/ninja on this machine: native %s kernels off (torch operators instead)", name)
        return None
    sources = [SOURCE_DIR / f"{name}.cpp"]
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    try:
        with _build_lock(build_dir):
            cpp_extension.load(
                name=f"tokenway_{name}",
                sources=[str(source) for source in sources],
                build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        return getattr(torch.ops, f"tokenway_{name}")
    except Exception as exc:  # a compiler error is a reason to fall back, never to stop serving
        logger.warning("tokenway: building native %s kernels failed (%s): torch operators instead", name,
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory for this process's build or load. torch's own lock is a file
    that exists while a build runs (FileBaton), and a builder killed mid-build leaves it behind:
    every later start would wait on it forever. An flock is released by the kernel when its
    holder dies, so under it a torch lock file can only be such a leftover, and it goes."""
    with open(build_dir / ".tokenway-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("tokenway: removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield
