"""Gatekeeper.admit alone against a real Redis: what a budget adds to a call's admission.

    python bench/admit_bench.py                       # a private redis-server; 2000 calls a run, 5 repeats
    python bench/admit_bench.py --baseline /path/to/other/checkout --redis-url redis://127.0.0.1:6390/0

Each run is a fresh process (of this checkout's code, or of --baseline's) with a Gatekeeper on
RedisLimiter and RedisBudgets (one Redis, as `tokenway serve --limits-url` builds them). It makes
num_calls sequential calls for one key with limits far above the load: admit, then settle both
reservations (in the foreground, timed apart), as a served call would. Configurations run in
alternation (plain, budget, and the baseline's), so all meet the machine at the same moments;
each figure is the median over repeats of the runs' percentiles, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from gateway_bench import percentile, start_redis, stop_process  # noqa: E402 (bench/ is not a package)

MODEL = "m"


async def one_run(redis_url: str, num_calls: int, budget: bool, workdir: Path) -> dict[str, float]:
    """Run in the child process, on the code its PYTHONPATH names."""
    from tokenway.billing.ledger import Ledger
    from tokenway.billing.pricing import ModelPrice, PriceTable
    from tokenway.gateway.auth import Principal
    from tokenway.gateway.budgets import make_budgets
    from tokenway.gateway.gatekeeper import Defaults, Gatekeeper
    from tokenway.gateway.keystore import KeyStore
    from tokenway.gateway.limits import make_limiter

    ledger = Ledger(f"sqlite:///{workdir / f'{uuid.uuid4().hex}.db'}")
    gate = Gatekeeper(KeyStore(workdir / "keys.db"), make_limiter(redis_url), ledger,
                      PriceTable({MODEL: ModelPrice(input=0.15, output=0.6)}), Defaults(), host="127.0.0.1",
                      budgets=make_budgets(redis_url, ledger.spend_usd))
    principal = Principal(key_id=f"bench-{uuid.uuid4().hex[:12]}", name="bench", rpm=10**9, tpm=10**12,
                          budget_usd=10**6 if budget else None)
    admit_s, settle_s = [], []
    try:
        for i in range(num_calls + num_calls // 10):  # the first tenth warms up: connections, script loads, seed
            start = time.perf_counter()
            admission = await gate.admit(principal, MODEL, 1, 1)
            admitted = time.perf_counter()
            await gate._settle_stores(admission.decision.reservation, 2, admission.budget, 1)
            if i >= num_calls // 10:
                admit_s.append(admitted - start)
                settle_s.append(time.perf_counter() - admitted)
    finally:
        await gate.close()
    return {"admit_p50": percentile(admit_s, 50) * 1000, "admit_p99": percentile(admit_s, 99) * 1000,
            "settle_p50": percentile(settle_s, 50) * 1000, "settle_p99": percentile(settle_s, 99) * 1000}


def spawn_run(repo: Path, redis_url: str, num_calls: int, budget: bool, workdir: Path) -> dict[str, float]:
    args = [sys.executable, str(Path(__file__).resolve()), "--child", "--redis-url", redis_url,
            "--num-calls", str(num_calls), "--workdir", str(workdir)] + (["--budget"] if budget else [])
    result = subprocess.run(args, check=True, capture_output=True, text=True, cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="an existing Redis (default: a private redis-server)")
    parser.add_argument("--baseline", type=Path, help="another checkout of tokenway: run its code too")
    parser.add_argument("--num-calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budget", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(one_run(args.redis_url, args.num_calls, args.budget, args.workdir))))
        return

    repos = {"": REPO} | ({"@base": args.baseline.resolve()} if args.baseline is not None else {})
    configs = [(f"{kind}{label}", repo, kind == "budget") for label, repo in repos.items() for kind in ("plain",
                                                                                                        "budget")]
    redis = None
    with tempfile.TemporaryDirectory(prefix="admit-bench-") as workdir:
        try:
            redis_url = args.redis_url
            if redis_url is None:
                redis, redis_url = start_redis(Path(workdir))
            config_to_runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in configs}
            for _ in range(args.repeats):
                for name, repo, budget in configs:
                    config_to_runs[name].append(spawn_run(repo, redis_url, args.num_calls, budget, Path(workdir)))
        finally:
            if redis is not None:
                stop_process(redis)
    print(f"Gatekeeper.admit then settle, {args.num_calls} sequential calls a run, median of {args.repeats} runs "
          f"in alternation, ms; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'config':<14} {'admit50':>8} {'admit99':>8} {'settle50':>9} {'settle99':>9}")
    name_to_stats = {}
    for name, runs in config_to_runs.items():
        stats = name_to_stats[name] = {field: statistics.median(run[field] for run in runs) for field in runs[0]}
        print(f"{name:<14} {stats['admit_p50']:8.3f} {stats['admit_p99']:8.3f} {stats['settle_p50']:9.3f} "
              f"{stats['settle_p99']:9.3f}")
    for label in repos:
        plain, budget = name_to_stats[f"plain{label}"], name_to_stats[f"budget{label}"]
        print(f"budget adds{label:<6} admit p50 {budget['admit_p50'] - plain['admit_p50']:+.3f} ms, "
              f"settle p50 {budget['settle_p50'] - plain['settle_p50']:+.3f} ms")


if __name__ == "__main__":
    main()
