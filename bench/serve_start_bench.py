"""How long `tokenway serve` takes from spawn to its first /ready 200, and to stop.

    python bench/serve_start_bench.py                    # the default model, 5 starts
    python bench/serve_start_bench.py --runs 9 -- --model /path/to/model.gguf --max-model-len 4096

Each run is a fresh `tokenway serve` (this checkout's, run from its root)
on a free loopback port with its own database, polled every 20 ms until /ready answers 200 (the
engine loaded, the app serving); then SIGINT, timed to its exit. The first run may convert a
GGUF into the cache or build the native kernels: it is printed apart and left out of the median.
Arguments after `--` go to `tokenway serve`.
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_start(extra: list[str], timeout_s: float) -> tuple[float, float]:
    """Seconds to /ready 200, and to exit after SIGINT."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tw-start-") as folder:
        started = time.monotonic()
        # The console script's way in (`-m tokenway.cli` would import the CLI twice, and the engine
        # process would import it again as its parent's main module), run from this checkout.
        process = subprocess.Popen([sys.executable, "-c", "import sys; from tokenway.cli import main; sys.exit(main())",
                                    "serve", "--port", str(port),
                                    "--db", f"{folder}/keys.db", *extra],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"serve exited with {process.returncode}: "
                                       f"{process.stderr.read().decode()[-2000:] if process.stderr else ''}")
                if time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"not ready within {timeout_s} s")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            ready = time.monotonic() - started
            stopping = time.monotonic()
            process.send_signal(signal.SIGINT)
            process.wait(60)
            return ready, time.monotonic() - stopping
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("serve_args", nargs="*", help="after --: passed to tokenway serve")
    args = parser.parse_args()
    first, first_stop = one_start(args.serve_args, args.timeout)
    print(f"first start: ready in {first:.2f} s, stopped in {first_stop:.2f} s")
    readies, stops = [], []
    for _ in range(max(1, args.runs - 1)):
        ready, stop = one_start(args.serve_args, args.timeout)
        readies.append(ready)
        stops.append(stop)
        print(f"  ready in {ready:.2f} s, stopped in {stop:.2f} s")
    print(f"spawn to /ready: median {statistics.median(readies):.2f} s (min {min(readies):.2f}, "
          f"max {max(readies):.2f}); SIGINT to exit: median {statistics.median(stops):.2f} s; "
          f"{len(readies)} starts after the first")


if __name__ == "__main__":
    main()
