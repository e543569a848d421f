#!/usr/bin/env bash
# tokenway beside llama.cpp (and OpenVINO GenAI where it loads the file) on models at real sizes,
# one run, one markdown table: $OUT/table.md.
#
#   bash bench/models_bench.sh                                   # llama-3.2-1b, smollm2-1.7b x Q4_K_M, Q4_0
#   SHAPES="llama-3.2-1b gemma3-270m" QUANTS="Q4_K_M Q4_0" bash bench/models_bench.sh
#
# Per file: llama-bench pp512 / tg64 with and without weight repacking (the faster is taken, and
# named), ../shared/bench/peers.sh with PEERS="llama-server self" (short dataset, C = 1 and 16,
# ignore_eos on), tokenway's own pp512 (bench/prefill_bench.py), each server's start time (spawn
# to /health 200) and peak RSS (the VmHWM of every process in the server's process group, summed,
# sampled through the load run), and the bandwidth one stream implies (file bytes / TPOT p50)
# against a plain 2-thread memory read measured in the same run.
#
# Random-weight Llama-shaped GGUFs (../shared/bench/random_gguf.py's, F16, by bench/random_gguf_stream.py) are made and quantised
# once into $PEERS_DIR/models. SHAPES=gemma3-270m is the real Gemma 3 270M Q4_K_M
# ($GEMMA3_GGUF, default tests/.gemma3/, which tests/conftest.py's gemma3_gguf fixture assembles).
# Knobs: SHAPES, QUANTS, OUT, THREADS (2), TW_SRC (the tokenway tree to serve: default this one),
# TW_ARGS (extra `tokenway serve` flags), TIME_LIMIT (per load run, s), OPENVINO (1: try it on Q4_0).
# Run it alone: every figure shares the same cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$ROOT/../shared/bench}
PEERS_DIR=${PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenway-peers}
BIN=${BIN:-$PEERS_DIR/bin}
TW_SRC=${TW_SRC:-$ROOT}
TW_PY=${TW_PY:-$ROOT/.venv/bin/python}
# The console script, not `python -m`: that would put the working directory ahead of TW_SRC on sys.path.
TW_SERVE=${TW_SERVE:-$(dirname "$TW_PY")/tokenway serve}
OV_PY=${OV_PY:-$PEERS_DIR/openvino-venv/bin/python}
SHAPES=${SHAPES:-"llama-3.2-1b smollm2-1.7b"}
QUANTS=${QUANTS:-"Q4_K_M Q4_0"}
THREADS=${THREADS:-2}
GEMMA3_GGUF=${GEMMA3_GGUF:-$ROOT/tests/.gemma3/gemma-3-270m-q4_k_m.gguf}
# The KV cache llama-server gets from peers.sh (16 slots x 2048 tokens) is about 1 GiB for a 1B model.
TW_ARGS=${TW_ARGS:-"--max-model-len 4096 --kv-cache-memory 1GiB"}
TIME_LIMIT=${TIME_LIMIT:-100}
OPENVINO=${OPENVINO:-1}
OUT=${OUT:-$PEERS_DIR/results/models-$(date +%Y%m%d-%H%M%S)}
TW_PORT=18090
mkdir -p "$OUT" "$PEERS_DIR/models"
export PYTHONPATH=$TW_SRC  # the tree under test, whatever the venv's editable install points at
echo "results -> $OUT"

model_files() {  # one path per line: the files SHAPES x QUANTS name, made on first use
  local shape q f16 out
  for shape in $SHAPES; do
    if [ "$shape" = gemma3-270m ]; then
      [ -f "$GEMMA3_GGUF" ] || { echo "no $GEMMA3_GGUF: run tests/models/test_gemma3_real.py once" >&2; exit 1; }
      echo "$GEMMA3_GGUF"; continue
    fi
    f16=$PEERS_DIR/models/$shape.f16.gguf
    if [ ! -f "$f16" ]; then
      # The shared script's bytes, written a tensor at a time (an 8B F16 is 16 GB: it would not fit in memory).
      "$TW_PY" "$ROOT/bench/random_gguf_stream.py" "$shape" "$f16.tmp" --shared "$SHARED/random_gguf.py" >&2 && mv "$f16.tmp" "$f16"
    fi
    for q in $QUANTS; do
      out=$PEERS_DIR/models/$shape.$q.gguf
      if [ ! -f "$out" ]; then
        "$BIN/llama-quantize" "$f16" "$out.tmp" "$q" >"$OUT/quantize.log" 2>&1 && mv "$out.tmp" "$out"
      fi
      echo "$out"
    done
  done
}

wait_health() {  # $1 url, $2 pid -> seconds from now until GET /health answers 200
  local started=$EPOCHREALTIME
  for _ in $(seq 1200); do
    if curl -sf -o /dev/null "$1/health"; then
      python3 -c "print(f'{$EPOCHREALTIME - $started:.2f}')"; return 0
    fi
    kill -0 "$2" 2>/dev/null || { echo "server died" >&2; return 1; }
    sleep 0.1
  done
  return 1
}

start_time() {  # $1 name, $2.. command: spawn it in its own group, time it to /health, stop it
  local name=$1 url=$2; shift 2
  setsid "$@" >"$OUT/$name.start.log" 2>&1 &
  local pid=$!
  wait_health "$url" "$pid" >"$OUT/$name.start_s" || echo nan >"$OUT/$name.start_s"
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# Samples, every 0.5 s, whichever process group listens on each port, and keeps per port the
# largest sum of its processes' VmHWM: peak resident memory of the server with its workers.
RSS_WATCHER='
import json, os, sys, time
ports, out = [int(p) for p in sys.argv[2:]], sys.argv[1]
peak = {p: 0 for p in ports}
def listening_inodes(port):
    hexport = f"{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            f = line.split()
            if f[1].endswith(":" + hexport) and f[3] == "0A":
                yield f[9]
def pgid_of(port):
    inodes = {f"socket:[{i}]" for i in listening_inodes(port)}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return os.getpgid(int(pid))
        except OSError:
            pass
def group_hwm_kib(pgid):
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                total += next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM"))
        except (OSError, StopIteration):
            pass
    return total
groups = {}
while True:
    for port in ports:
        if port not in groups or groups[port] is None:
            groups[port] = pgid_of(port)
        elif groups[port] and not os.path.exists(f"/proc/{groups[port]}"):
            groups[port] = pgid_of(port)  # a fresh server per run: a new group
        if groups[port]:
            peak[port] = max(peak[port], group_hwm_kib(groups[port]))
    with open(out + ".tmp", "w") as f:
        json.dump(peak, f)
    os.replace(out + ".tmp", out)
    time.sleep(0.5)
'

{ echo "date: $(date -Is)"; echo "host: $(nproc) cpu,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)";
  echo "tokenway: $(git -C "$TW_SRC" rev-parse --short HEAD) ($TW_SRC) serve $TW_ARGS";
  echo "llama.cpp: $("$BIN/llama-server" --version 2>&1 | grep -m1 version)"; } | tee "$OUT/env.txt"
(cd "$TW_SRC" && "$TW_PY" - "$THREADS" "$TW_SRC/bench") >"$OUT/plain_read_gbs" <<'EOF'
import sys
import torch
sys.path.insert(0, sys.argv[2])
torch.set_num_threads(int(sys.argv[1]))
from quant_bench import plain_read_seconds
print(f"{(1 << 30) / plain_read_seconds(1 << 30, 5) / 1e9:.2f}")
EOF
echo "plain read, $THREADS threads: $(cat "$OUT/plain_read_gbs") GB/s"

mapfile -t FILES < <(model_files)
for f in "${FILES[@]}"; do
  name=$(basename "$f" .gguf)
  dir=$OUT/$name
  mkdir -p "$dir"
  echo "== $name ($(du -h "$f" | cut -f1))"
  # (a) llama.cpp's kernels alone; --repack 1 is its default, 0 is what peers.sh serves with.
  "$BIN/llama-bench" -m "$f" -t "$THREADS" -p 512 -n 64 -r 2 --repack 0,1 -o json >"$dir/llama_bench.json" \
    2>"$dir/llama_bench.log" || "$BIN/llama-bench" -m "$f" -t "$THREADS" -p 512 -n 64 -r 2 --repack 0 -o json \
    >"$dir/llama_bench.json" 2>>"$dir/llama_bench.log"
  # The server gets the repack setting that decoded faster.
  repack=$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x['n_gen']]; \
print(max(r, key=lambda x: x['avg_ts']).get('repack', False))" "$dir/llama_bench.json")
  llama_args=$([ "$repack" = True ] && echo "" || echo "--no-repack")
  echo "$llama_args" >"$dir/llama_args"
  # (c) tokenway's prompt processing.
  "$TW_PY" "$TW_SRC/bench/prefill_bench.py" --model "$f" --lengths 512 --repeats 3 >"$dir/prefill.txt" 2>&1 || true
  # (d) start times, each server alone, with the flags peers.sh gives it: the second of two starts
  # (the first builds what a first start builds: tokenway's serving kernels, which prefill_bench
  # does not load, and the page cache), as on any start after the first.
  for _ in 1 2; do
    start_time llama-server-$name http://127.0.0.1:18080 "$BIN/llama-server" -m "$f" -t "$THREADS" -tb "$THREADS" \
      -np 16 -c 32768 --host 127.0.0.1 --port 18080 $llama_args
    start_time tokenway-$name "http://127.0.0.1:$TW_PORT" $TW_SERVE --model "$f" --port "$TW_PORT" $TW_ARGS
  done
  mv "$OUT/llama-server-$name.start_s" "$dir/llama-server.start_s"
  mv "$OUT/tokenway-$name.start_s" "$dir/self.start_s"
  # (b) serving, with (d) peak RSS sampled alongside.
  "$TW_PY" -c "$RSS_WATCHER" "$dir/rss_kib.json" 18080 "$TW_PORT" &
  watcher=$!
  OUT=$dir GGUF=$f PEERS="llama-server self" LLAMA_ARGS="$llama_args" IGNORE_EOS=on CONCURRENCY="1 16" \
    DATASETS=short KERNEL_BENCH=0 TIME_LIMIT=$TIME_LIMIT THREADS=$THREADS \
    SELF_CMD="$TW_SERVE --model $f --port $TW_PORT $TW_ARGS" SELF_URL=http://127.0.0.1:$TW_PORT \
    bash "$SHARED/peers.sh" >"$dir/peers.log" 2>&1 || echo "peers.sh failed: see $dir/peers.log"
  kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null || true
  grep -h '^\[' "$dir/summary.txt" 2>/dev/null || true
  # (optional) OpenVINO GenAI reads Q4_0 / Q8_0 / F16 GGUFs itself.
  if [ "$OPENVINO" = 1 ] && [ -x "$OV_PY" ] && [[ $name == *Q4_0* ]]; then
    "$OV_PY" "$ROOT/bench/openvino_peer.py" "$f" --threads "$THREADS" >"$dir/openvino.json" 2>"$dir/openvino.log" || true
    cat "$dir/openvino.json"
  fi
done

python3 - "$OUT" "${FILES[@]}" <<'EOF' | tee "$OUT/table.md"
import json, os, re, sys
out, files = sys.argv[1], sys.argv[2:]
plain = float(open(f"{out}/plain_read_gbs").read())
def load(path, default=None):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return default
def text(path):
    try:
        return open(path).read().strip()
    except OSError:
        return ""
def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"
def num(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) and x == x else "-"
print(f"plain 2-thread read: {plain:.1f} GB/s; tok/s = output tokens/s (short dataset, 64 tokens each, ignore_eos); "
      "TPOT p50 at c=1; pp512 = prompt tok/s for 512 tokens; bw = file bytes / TPOT as a share of the plain read\n")
print("| file | size | llama c=1 | tw c=1 | tw/llama | llama c=16 | tw c=16 | tw/llama | TPOT llama / tw ms "
      "| pp512 llama (repack) / tw | RSS llama / tw MiB | start llama / tw s | bw llama / tw | OpenVINO c=1 / c=16 |")
print("|" + "---|" * 14)
for f in files:
    name = os.path.basename(f)[:-5]
    d = f"{out}/{name}"
    size = os.path.getsize(f)
    runs = {(p, c): load(f"{d}/{p}_short_c{c}.json", {}) for p in ("llama-server", "self") for c in (1, 16)}
    tps = {k: v.get("output_throughput") for k, v in runs.items()}
    tpot = {p: runs[(p, 1)].get("tpot_ms", {}).get("p50") for p in ("llama-server", "self")}
    bench = load(f"{d}/llama_bench.json", [])
    pp = [b for b in bench if b["n_prompt"] == 512 and not b["n_gen"]]
    best_pp = max(pp, key=lambda b: b["avg_ts"], default=None)
    pp_llama = f"{best_pp['avg_ts']:.0f} ({'on' if best_pp.get('repack') else 'off'})" if best_pp else "-"
    m = re.search(r"cold .*?\(\s*(\d+) tok/s\)", text(f"{d}/prefill.txt"))
    pp_tw = m.group(1) if m else "-"
    rss = load(f"{d}/rss_kib.json", {})
    rss_l, rss_t = (rss.get(str(p), 0) / 1024 for p in (18080, 18090))
    bw = {p: size / (tpot[p] / 1e3) / 1e9 / plain * 100 if tpot[p] else None for p in tpot}
    ov = load(f"{d}/openvino.json")
    ov_cell = ("-" if ov is None else f"no: {ov['error'][:60]}" if "error" in ov
               else f"{ov['c1_tok_s']:.1f} / {ov['c16_tok_s']:.1f}")
    print(f"| {name} | {size / 2**30:.2f} GiB | {num(tps[('llama-server', 1)])} | {num(tps[('self', 1)])} "
          f"| {ratio(tps[('self', 1)], tps[('llama-server', 1)])} | {num(tps[('llama-server', 16)])} "
          f"| {num(tps[('self', 16)])} | {ratio(tps[('self', 16)], tps[('llama-server', 16)])} "
          f"| {num(tpot['llama-server'])} / {num(tpot['self'])} | {pp_llama} / {pp_tw} "
          f"| {rss_l:.0f} / {rss_t:.0f} | {text(f'{d}/llama-server.start_s') or '-'} / {text(f'{d}/self.start_s') or '-'} "
          f"| {num(bw['llama-server'], '{:.0f}%')} / {num(bw['self'], '{:.0f}%')} | {ov_cell} |")
EOF
