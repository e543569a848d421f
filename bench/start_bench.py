"""How long a model takes to start, and the memory it holds, first and second time.

    python bench/start_bench.py MODEL [--runs 2] [--kv-cache-memory 512MiB] [--fresh-cache]

Each run is a fresh process that builds the engine (EngineCore: resolve, load, kernels, KV cache)
and reports its wall time and peak RSS (VmHWM). The first run of a GGUF describes it and relays its
blocks into the cache (models/weights.KernelCache); later runs map them. Printed beside the GGUF's
size and the KV cache's, the goal's terms: a second start in seconds, RSS about weights + KV cache.
--fresh-cache starts from an empty TOKENWAY_CACHE_DIR (a temporary one), so run 1 is a first start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
started = time.monotonic()
from tokenway.config import EngineConfig
from tokenway.engine.core import EngineCore
from tokenway.engine.runner import kv_bytes_per_block
engine = EngineCore(EngineConfig(model=sys.argv[1], kv_cache_memory=sys.argv[2], show_progress=False))
seconds = time.monotonic() - started
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kv = engine.kv_manager.num_blocks * kv_bytes_per_block(engine.model_config, engine.config.block_size, engine.dtype)
print(json.dumps({"seconds": seconds, "peak_rss": int(status["VmHWM"].split()[0]) * 1024,
                  "rss": int(status["VmRSS"].split()[0]) * 1024, "kv_bytes": kv,
                  "quantized": engine.model.num_quantized_matmuls}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--fresh-cache", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ)
    scratch = tempfile.TemporaryDirectory() if args.fresh_cache else None
    if scratch is not None:
        env["TOKENWAY_CACHE_DIR"] = scratch.name
        # the native kernels are built once per machine: reuse them, or run 1 would time a compiler
        native = Path(os.environ.get("TOKENWAY_CACHE_DIR") or Path.home() / ".cache" / "tokenway") / "native"
        if native.is_dir():
            os.symlink(native, Path(scratch.name) / "native")
    size = Path(args.model).stat().st_size if Path(args.model).is_file() else None
    print(f"model {args.model}" + (f" ({size / 2**30:.2f} GiB)" if size else ""))
    print(f"{'run':>4} {'start s':>8} {'peak RSS GiB':>13} {'RSS GiB':>8} {'KV GiB':>7} {'file+KV+1 GiB':>14}"
          "  matmuls on blocks")
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.kv_cache_memory], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"run {run} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        bound = "" if size is None else f"{(size + result['kv_bytes']) / 2**30 + 1:14.2f}"
        print(f"{run:>4} {result['seconds']:8.1f} {result['peak_rss'] / 2**30:13.2f} {result['rss'] / 2**30:8.2f} "
              f"{result['kv_bytes'] / 2**30:7.2f} {bound}  {result['quantized']}"
              f"   (process {time.monotonic() - started:.1f} s)")
    if scratch is not None:
        scratch.cleanup()


if __name__ == "__main__":
    main()
