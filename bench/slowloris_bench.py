"""/health latency while half-open connections arrive (slowloris), and whether it is answered.

    python bench/slowloris_bench.py                           # this checkout, 20,000 connections
    python bench/slowloris_bench.py --repo /tmp/old-tree      # ... and another checkout, in the same run
    python bench/slowloris_bench.py --sources 127.0.0.1       # the flood shares the checker's address

For each checkout: `tokenway serve --no-embeddings`; /health checked every --interval seconds
on a new connection (as a load balancer does) for --seconds with nothing else running, then
again while two processes (tests/e2e/half_open.py) open --connections connections that each
send half a request head and hold them for --seconds. Prints, per phase, how many checks were
answered 200 and their p50/p99/max, and what the floods saw (connected, closed by the server).
The RLIMIT_NOFILE of this machine bounds what one process may hold: two floods together can
hold more than the server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_bench import REPO, start_server  # noqa: E402

from tests.e2e.half_open import Flood, HealthProber  # noqa: E402


def measure(repo: Path, args: argparse.Namespace, workdir: Path) -> None:
    log = open(workdir / f"{repo.name}.log", "w")  # noqa: SIM115 (the server holds it open)
    process, base_url = start_server("--no-embeddings", "--db", str(workdir / f"{repo.name}.db"), repo=repo, log=log)
    port = int(base_url.rsplit(":", 1)[1])
    try:
        with HealthProber(port, interval=args.interval) as idle:
            time.sleep(args.seconds)
        print(f"{repo}: idle:  /health {idle.summary()}", flush=True)
        sources = tuple(args.sources.split(","))
        with HealthProber(port, interval=args.interval) as flooded:
            floods = [Flood.start(port, args.connections // 2, sources[k::2] or sources) for k in range(2)]
            try:
                opened = [flood.wait_opened() for flood in floods]
                time.sleep(args.seconds)
            finally:
                stats = [flood.stop() for flood in floods]
        failed = [s for s in flooded.statuses if s != 200]
        print(f"{repo}: flood: /health {flooded.summary()}; {len(failed)} failed", flush=True)
        print(f"    floods: {sum(o['num_connected'] for o in opened)} connected in "
              f"{max(o['seconds'] for o in opened)} s, {sum(o['num_failed'] for o in opened)} failed to; "
              f"{sum(s.num_closed_by_server for s in stats)} closed by the server by the end", flush=True)
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, action="append", default=[], help="another checkout to measure too")
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--sources", default=",".join(f"127.0.0.{i}" for i in range(2, 10)),
                        help="the floods' source addresses, comma-separated (the checker uses 127.0.0.1)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each phase's length (the flood's: once opened)")
    parser.add_argument("--interval", type=float, default=0.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for repo in [REPO, *args.repo]:
            measure(repo.resolve(), args, Path(workdir))


if __name__ == "__main__":
    main()
