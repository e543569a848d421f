"""Where a serving process's memory goes: `tokenway serve` in this process, under tracemalloc,
with the allocator's own counters, printed each interval as growth since the first sample.

    python bench/memory_diag.py --port 8123 &       # then load it, e.g.:
    python bench/soak.py --base-url http://127.0.0.1:8123 --pid $! --minutes 10 --warmup 1

Each interval: RSS; glibc's mallinfo2 (in use by malloc, free but kept in its arenas, mmapped);
Python's tracemalloc total; and the ten source lines whose live Python allocations grew most.
RSS growing with `arena free` means fragmentation (memory freed but not returned); with
`malloc in use` but not tracemalloc, native allocations (torch, tokenizers, llguidance);
with tracemalloc, Python objects (the lines say which).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo() -> MallInfo2:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def report(interval_s: float, trace: bool) -> None:
    first = None
    mib = 2**20
    while True:
        time.sleep(interval_s)
        info = mallinfo()
        snapshot = tracemalloc.take_snapshot() if trace else None
        traced = tracemalloc.get_traced_memory()[0] / mib if trace else 0.0
        now = {"rss": rss_mib(), "in_use": info.uordblks / mib, "arena_free": info.fordblks / mib,
               "mmapped": info.hblkhd / mib, "traced": traced}
        if first is None:
            first = (now, snapshot)
        base, base_snapshot = first
        print(f"\n[{time.strftime('%H:%M:%S')}] " + "  ".join(
            f"{name} {value:.0f} MiB ({value - base[name]:+.0f})" for name, value in now.items()), flush=True)
        for stat in snapshot.compare_to(base_snapshot, "lineno")[:10] if trace else ():
            print(f"    {stat.size_diff / 1024:+9.0f} KiB {stat.count_diff:+8d} blocks  {stat.traceback}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--no-tracemalloc", dest="trace", action="store_false",
                        help="the allocator's counters only (tracemalloc slows serving several times)")
    args, serve_args = parser.parse_known_args()
    if args.trace:
        tracemalloc.start(1)
    threading.Thread(target=report, args=(args.interval, args.trace), daemon=True).start()
    from tokenway.cli import main as tokenway_main

    sys.exit(tokenway_main(["serve", *serve_args]))


if __name__ == "__main__":
    main()
