"""tokenway's own CPU kernels (C++, OpenMP), compiled for the CPU they run on.

Each extension is built once per machine with torch.utils.cpp_extension (g++ and ninja) under
`$TOKENWAY_CACHE_DIR/native/<name>-<key>`, where the key covers the sources and their tree, torch's version
and this CPU's instruction-set flags: a cache carried to a CPU without AVX512 is never loaded
there, it is rebuilt for it. `-march=native` lets the compiler use what this CPU has.

TOKENWAY_NATIVE_ISA=avx2 (or avx2-vnni, scalar) builds every extension for less than this CPU
has, as a machine without AVX512 would (its own build directory): to run those paths here.
`load(name, isa)` also builds one extension for another instruction set beside the process's
own, under the library name tokenway_<name>_<isa> (its source names its library
TOKENWAY_LIBRARY; csrc/quant.cpp does), so tests can hold each path to the same answers.

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

from tokenway.config import default_cache_dir

logger = logging.getLogger("tokenway.native")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_loaded: dict[tuple[str, str], ModuleType | None] = {}

# Instruction sets an extension can be built for: compiler flags, and the CPU flags they need.
ISA_FLAGS: dict[str, tuple[list[str], frozenset[str]]] = {
    "native": (["-march=native"], frozenset()),
    "avx2": (["-march=haswell", "-mtune=native"], frozenset({"avx2", "fma", "f16c"})),
    "avx2-vnni": (["-march=haswell", "-mavxvnni", "-mtune=native"], frozenset({"avx2", "fma", "f16c", "avx_vnni"})),
    "scalar": (["-march=x86-64", "-mtune=native"], frozenset()),
}


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def process_isa() -> str:
    """The instruction set this process's extensions are built for (TOKENWAY_NATIVE_ISA)."""
    isa = os.environ.get("TOKENWAY_NATIVE_ISA", "native").lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"TOKENWAY_NATIVE_ISA: one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def _key(sources: list[Path], isa: str) -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(isa.encode())
    # ninja's build file names the sources by path and rebuilds when their mtimes are newer: two
    # trees of the same sources (a checkout and a worktree) sharing one directory would rebuild
    # each other's extension on every alternate start.
    digest.update(str(SOURCE_DIR).encode())
    flags = sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx", "fma", "f16c", "sse", "bmi")))
    digest.update(" ".join(flags).encode())
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def disabled() -> bool:
    return os.environ.get("TOKENWAY_NATIVE", "1").lower() in ("0", "false", "no", "off")


def load(name: str, isa: str | None = None) -> ModuleType | None:
    """The operators csrc/<name>.cpp registers with `TORCH_LIBRARY(tokenway_<name>, m)`, as
    `torch.ops.tokenway_<name>`, or None (no compiler, a failed build, or TOKENWAY_NATIVE=0).
    isa: build for that instruction set (ISA_FLAGS) rather than the process's; such a build is
    `torch.ops.tokenway_<name>_<isa>`, and None where this CPU cannot run it."""
    process = process_isa()
    isa = process if isa is None else isa
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa: one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    with _lock:
        if (name, isa) not in _loaded:
            runs_here = ISA_FLAGS[isa][1] <= cpu_flags()
            library = f"tokenway_{name}" if isa == process else f"tokenway_{name}_{isa.replace('-', '_')}"
            _loaded[name, isa] = None if disabled() or not runs_here else _build(name, isa, library)
        return _loaded[name, isa]


def build_directory(name: str, isa: str | None = None) -> Path:
    """Where extension `name` is built for this CPU, these sources and this torch."""
    isa = process_isa() if isa is None else isa
    sources = _sources(name)
    headers = sorted(SOURCE_DIR.glob("*.h"))  # shared by the kernels: a change rebuilds them all
    tag = name if isa == "native" else f"{name}-{isa}"
    return default_cache_dir() / "native" / f"{tag}-{_key(sources + headers, isa)}"


def _sources(name: str) -> list[Path]:
    return [SOURCE_DIR / f"{name}.cpp"]


def _build(name: str, isa: str, library: str) -> ModuleType | None:
    if shutil.which("g++") is None or shutil.which("ninja") is None:
        logger.warning("tokenway: no g++/ninja on this machine: native %s kernels off (torch operators instead)", name)
        return None
    build_dir = build_directory(name, isa)
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    try:
        with _build_lock(build_dir):
            cpp_extension.load(
                name=library,
                sources=[str(source) for source in _sources(name)],
                build_directory=str(build_dir),
                extra_cflags=["-O3", *ISA_FLAGS[isa][0], "-fopenmp", "-ffast-math", "-fno-finite-math-only",
                              f"-DTOKENWAY_LIBRARY={library}"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        return getattr(torch.ops, library)
    except Exception as exc:  # a compiler error is a reason to fall back, never to stop serving
        logger.warning("tokenway: building native %s kernels (%s) failed (%s): torch operators instead", name, isa,
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
