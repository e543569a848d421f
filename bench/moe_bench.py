"""Mixture-of-experts GGUFs: llama.cpp beside tokenway on the same file, against a plain 2-thread
read of the bytes one token reads.

    python bench/moe_bench.py ~/.cache/tokenway-peers/models/qwen3-30b-a3b.4L.Q4_K_M.gguf
    python bench/moe_bench.py FILE.gguf --serve llama-server,tokenway      # + serving at C = 1, 16
    python bench/moe_bench.py FILE.gguf --no-llama-bench --serve tokenway   # tokenway's half alone

Per file:
- bytes a token reads, from the file's tensor table: the dense tensors (attention, norms, routers,
  the head; one row of token_embd), plus each expert tensor (ne[2] = expert_count) times
  expert_used_count / expert_count: the experts one token routes to.
- a plain read of that many bytes by torch's 2 threads (torch.sum over a float32 buffer, best of
  20, the quietest moment of a shared machine): GB/s, and the tok/s one stream would reach if a
  token cost only that read (the floor).
- llama.cpp's llama-bench: pp512 and tg64 (one stream), for each weight-repack setting that runs
  (--repack 1 is its default; AMX builds crash on some types), each under /usr/bin/time -v for its
  peak RSS (the mapped file counts once touched; a repacked copy counts again).
- `--serve`: ../shared/bench/peers.sh with llama-server (-np 16) and/or `tokenway serve`, short
  prompts (distinct, so streams route to different experts), 64 tokens out, ignore_eos, C = 1 and
  16, with each server's peak RSS (its process group's summed VmHWM, sampled every 0.5 s); and
  tokenway's pp512 (bench/prefill_bench.py).

Prints one line per measurement and a summary table; writes everything under --out (default
$PEERS_DIR/results/moe-DATE/NAME/). One stream's % of the plain read = tok/s / floor tok/s.
Run it alone: every figure shares the same two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenway-peers"))
LLAMA_PORT, TOKENWAY_PORT = 18080, 18090


@dataclass(frozen=True)
class TokenBytes:
    """What one decode step of one stream reads from the weights, in bytes."""

    dense: int  # attention, norms, routers, shared tensors: every token reads them
    experts: int  # the expert_used_count experts of every layer
    head: int  # output.weight (or the tied token_embd)
    embedding_row: int
    file: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.head + self.embedding_row


def token_bytes(path: Path) -> TokenBytes:
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    n_expert = int(reader.fields[f"{arch}.expert_count"].contents())
    n_used = int(reader.fields[f"{arch}.expert_used_count"].contents())
    dense = experts = head = embedding_row = 0
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        ne = [int(n) for n in t.shape]  # GGUF order: ne[0] is the row length
        if t.name == "token_embd.weight":
            embedding_row = int(t.n_bytes) // ne[-1]
            if "output.weight" not in tensors:
                head = int(t.n_bytes)
        elif t.name == "output.weight":
            head = int(t.n_bytes)
        elif "_exps." in t.name or (len(ne) >= 2 and ne[-1] == n_expert and "gate_inp" not in t.name):
            experts += int(t.n_bytes) * n_used // n_expert
        else:
            dense += int(t.n_bytes)
    return TokenBytes(dense, experts, head, embedding_row, path.stat().st_size)


def plain_read_seconds(num_bytes: int, threads: int, repeats: int = 20) -> float:
    """The fastest of `repeats` sums over a float32 buffer of num_bytes by `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
    for _ in range(2):
        buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return best


def wait_quiet(limit: float | None, max_wait_s: float = 900) -> float:
    """Waits (at most max_wait_s) until the 1-minute load average is under `limit`; returns it.
    On a shared machine llama.cpp's 2-thread decode loses 5x when a third process wants a core
    (its threads spin at barriers): measure in quiet spells, and print the load with each figure."""
    deadline = time.monotonic() + max_wait_s
    while limit is not None and os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def timed_run(cmd: list[str], log: Path) -> tuple[int, str, int]:
    """(exit status, stdout, peak RSS KiB) of cmd under /usr/bin/time -v; stderr goes to log."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    log.write_text(proc.stderr)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return proc.returncode, proc.stdout, int(m.group(1)) if m else 0


def llama_bench(path: Path, out: Path, threads: int, repeats: int, prompt: int, gen: int,
                quiet: float | None) -> list[dict]:
    """One row per (repack, test): avg tok/s, the test, the run's peak RSS and the load average
    it started at."""
    rows = []
    for repack in (1, 0):
        load = wait_quiet(quiet)
        cmd = [str(PEERS_DIR / "bin" / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", str(prompt),
               "-n", str(gen), "-r", str(repeats), "--repack", str(repack), "-o", "json"]
        print("$", shlex.join(cmd), flush=True)
        status, stdout, rss_kib = timed_run(cmd, out / f"llama_bench.repack{repack}.log")
        if status != 0:
            print(f"  llama-bench --repack {repack} failed ({status}): see {out}/llama_bench.repack{repack}.log")
            continue
        for r in json.loads(stdout):
            test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
            rows.append({"repack": repack, "test": test, "tok_s": r["avg_ts"], "stddev": r["stddev_ts"],
                         "peak_rss_mib": rss_kib / 1024, "load": load})
            print(f"  llama.cpp repack {repack} {test}: {r['avg_ts']:.2f} tok/s (± {r['stddev_ts']:.2f}), "
                  f"peak RSS {rss_kib / 1024:.0f} MiB, load {load:.1f} at start", flush=True)
    (out / "llama_bench.json").write_text(json.dumps(rows, indent=1))
    return rows


class GroupRss:
    """Peak summed VmHWM of the process group listening on each port, sampled every 0.5 s."""

    def __init__(self, ports: list[int]):
        self.peak = {p: 0 for p in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GroupRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _pgid(port: int) -> int | None:
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[1].endswith(f":{port:04X}") and f[3] == "0A":
                    inodes.add(f"socket:[{f[9]}]")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                    return os.getpgid(int(pid))
            except OSError:
                pass
        return None

    @staticmethod
    def _hwm_kib(pgid: int) -> int:
        total = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) == pgid:
                    status = Path(f"/proc/{pid}/status").read_text()
                    total += int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
            except (OSError, AttributeError):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for port in self.peak:
                pgid = self._pgid(port)
                if pgid:
                    self.peak[port] = max(self.peak[port], self._hwm_kib(pgid))


def serve(path: Path, out: Path, peers: list[str], threads: int, time_limit: int, tokenway_args: str,
          llama_args: str, llama_ctx: int) -> dict:
    """peers.sh at C = 1 and 16 on the short dataset; {(peer, c): serve_bench result} + RSS."""
    tw = f"{ROOT / '.venv' / 'bin' / 'tokenway'} serve --model {path} --port {TOKENWAY_PORT} {tokenway_args}"
    env = {**os.environ, "OUT": str(out), "GGUF": str(path),
           "PEERS": " ".join("self" if p == "tokenway" else p for p in peers),
           "IGNORE_EOS": "on", "CONCURRENCY": "1 16", "DATASETS": "short", "KERNEL_BENCH": "0",
           "TIME_LIMIT": str(time_limit), "THREADS": str(threads), "LLAMA_ARGS": llama_args,
           "LLAMA_CTX": str(llama_ctx), "SELF_CMD": tw, "SELF_URL": f"http://127.0.0.1:{TOKENWAY_PORT}",
           "PYTHONPATH": str(ROOT)}
    print(f"$ PEERS='{env['PEERS']}' LLAMA_ARGS='{llama_args}' LLAMA_CTX={llama_ctx} SELF_CMD='{tw}' "
          f"bash {SHARED / 'peers.sh'}", flush=True)
    with GroupRss([LLAMA_PORT, TOKENWAY_PORT]) as rss, open(out / "peers.log", "w") as log:
        subprocess.run(["bash", str(SHARED / "peers.sh")], env=env, stdout=log, stderr=subprocess.STDOUT)
    results: dict = {"rss_mib": {"llama-server": rss.peak[LLAMA_PORT] / 1024,
                                 "tokenway": rss.peak[TOKENWAY_PORT] / 1024}}
    for peer in peers:
        name = "self" if peer == "tokenway" else peer
        for c in (1, 16):
            f = out / f"{name}_short_c{c}.json"
            r = json.loads(f.read_text()) if f.exists() else {}
            results[f"{peer} c={c}"] = {"tok_s": r.get("output_throughput"),
                                        "tpot_p50_ms": r.get("tpot_ms", {}).get("p50"),
                                        "completed": r.get("completed"), "errors": r.get("errors")}
            print(f"  {peer} c={c}: {r.get('output_throughput') or 0:.2f} tok/s, TPOT p50 "
                  f"{r.get('tpot_ms', {}).get('p50') or 0:.1f} ms", flush=True)
    if "tokenway" in peers:
        cmd = [sys.executable, str(ROOT / "bench" / "prefill_bench.py"), "--model", str(path), "--lengths", "512",
               "--repeats", "3"]
        print("$", shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        (out / "prefill.txt").write_text(proc.stdout + proc.stderr)
        m = re.search(r"cold .*?\(\s*(\d+) tok/s\)", proc.stdout)
        results["tokenway pp512"] = float(m.group(1)) if m else None
        print(f"  tokenway pp512: {results['tokenway pp512']} tok/s", flush=True)
    for peer in peers:
        print(f"  {peer} peak RSS {results['rss_mib'][peer]:.0f} MiB", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--no-llama-bench", action="store_true")
    ap.add_argument("--serve", default="", help="comma list of llama-server, tokenway")
    ap.add_argument("--time-limit", type=int, default=120, help="per load run, s (peers.sh TIME_LIMIT)")
    ap.add_argument("--tokenway-args", default="--max-model-len 4096 --kv-cache-memory 1GiB")
    ap.add_argument("--llama-args", default="--no-repack", help="llama-server flags (peers.sh LLAMA_ARGS)")
    ap.add_argument("--llama-ctx", type=int, default=16 * 1024, help="llama-server -c, over its 16 slots")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quiet", type=float, default=None,
                    help="wait (up to 15 min) for a 1-minute load average under this before each measurement")
    args = ap.parse_args()
    path = args.gguf.expanduser().resolve()
    out = args.out or PEERS_DIR / "results" / f"moe-{time.strftime('%Y%m%d-%H%M%S')}" / path.stem
    out.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.serve.split(",") if p]
    if unknown := set(peers) - {"llama-server", "tokenway"}:
        raise ValueError(f"--serve: unknown {sorted(unknown)}; expected llama-server, tokenway")

    tb = token_bytes(path)
    load = wait_quiet(args.quiet)
    seconds = plain_read_seconds(tb.total, args.threads)
    plain_gbs, floor = tb.total / seconds / 1e9, 1 / seconds
    summary: dict = {"file": str(path), "token_bytes": asdict(tb) | {"total": tb.total},
                     "plain_read_gbs": plain_gbs, "floor_tok_s": floor, "threads": args.threads, "load": load,
                     "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                     "tokenway": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                capture_output=True, text=True).stdout.strip()}
    print(f"{path.name}: {tb.file / 1e9:.2f} GB; a token reads {tb.total / 1e9:.3f} GB (dense {tb.dense / 1e9:.3f}, "
          f"active experts {tb.experts / 1e9:.3f}, head {tb.head / 1e9:.3f}); plain {args.threads}-thread read "
          f"{plain_gbs:.1f} GB/s -> floor {floor:.1f} tok/s (load {load:.1f})", flush=True)
    if not args.no_llama_bench:
        summary["llama_bench"] = llama_bench(path, out, args.threads, args.repeats, 512, 64, args.quiet)
    if peers:
        wait_quiet(args.quiet)
        summary["serve"] = serve(path, out, peers, args.threads, args.time_limit, args.tokenway_args,
                                 args.llama_args, args.llama_ctx)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

    rows = []
    for r in summary.get("llama_bench", []):
        share = f"{r['tok_s'] / floor * 100:.0f}%" if r["test"].startswith("tg") else ""
        rows.append((f"llama-bench {r['test']} repack {r['repack']}", f"{r['tok_s']:.2f}", share,
                     f"{r['peak_rss_mib']:.0f}"))
    served = summary.get("serve", {})
    for key, r in served.items():
        if isinstance(r, dict) and "tok_s" in r and r["tok_s"]:
            share = f"{r['tok_s'] / floor * 100:.0f}%" if key.endswith("c=1") else ""
            peer = key.split(" ")[0]
            rows.append((key, f"{r['tok_s']:.2f}", share, f"{served['rss_mib'].get(peer, 0):.0f}"))
    if served.get("tokenway pp512"):
        rows.append(("tokenway pp512", f"{served['tokenway pp512']:.0f}", "", ""))
    for c in (1, 16):
        a, b = served.get(f"tokenway c={c}", {}).get("tok_s"), served.get(f"llama-server c={c}", {}).get("tok_s")
        if a and b:
            rows.append((f"tokenway / llama-server c={c}", f"{a / b:.2f}x", "", ""))
    print(f"\n{path.name}, plain read {plain_gbs:.1f} GB/s over {tb.total / 1e9:.3f} GB/token "
          f"(floor {floor:.1f} tok/s); results in {out}")
    print("| run | tok/s | % of plain read | peak RSS MiB |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
