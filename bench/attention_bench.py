"""The C++ paged decode attention kernel alone, on SmolLM2-135M's shapes (9 heads, 3 KV heads,
head_dim 64, blocks of 16), per call (one layer) and x30 (one decode step's layers).

    python bench/attention_bench.py                      # bfloat16
    python bench/attention_bench.py --dtype float32
    python bench/attention_bench.py --threads 1

Workloads: one request of 100 and of 1,000 tokens; 16 requests of 60-120 tokens; 16 requests
behind one 1,008-token prefix they share (+20-90 tokens each), with the prefix passed to the
kernel (cascade: read once for the group) and without it (each row reads it on its own).
"hot" repeats one layer's call, so its keys and values stay in the CPU's caches; "cold" cycles
through 30 layers' caches and streams 32 MB between calls, as a decode step's weights do.
Each line also gives the largest difference from float64 attention over the whole contexts.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway.models.attention import native_decode_kernel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS, NUM_BLOCKS = 30, 3000


def reference(q, k_cache, v_cache, tables, lens):
    out = []
    for row, (table, length) in enumerate(zip(tables, lens)):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
        k = k_cache[slots].double().transpose(0, 1)  # (kv_heads, L, d)
        v = v_cache[slots].double().transpose(0, 1)
        qq = q[row].double().view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        out.append(((qq @ k.transpose(1, 2)) * HEAD_DIM ** -0.5).softmax(-1).matmul(v).reshape(HEADS, HEAD_DIM))
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=1.0, help="per workload and cache state")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    kernel = native_decode_kernel(dtype, HEAD_DIM, torch.device("cpu"))
    if kernel is None:
        sys.exit("the native attention kernel does not build here")
    torch.manual_seed(0)
    caches = [(torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
               torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM).to(dtype)) for _ in range(LAYERS)]
    junk = torch.randn(8 * 2**20)  # 32 MB
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}")

    def workload(name, lens, shared_blocks=0, cascade=False):
        rng = random.Random(1)
        free = list(range(NUM_BLOCKS))
        rng.shuffle(free)
        shared = [free.pop() for _ in range(shared_blocks)]
        tables = [shared + [free.pop() for _ in range(-(-n // BLOCK) - shared_blocks)] for n in lens]
        width = max(map(len, tables))
        q = torch.randn(len(lens), HEADS, HEAD_DIM).to(dtype)
        call = [q, None, None, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32), BLOCK, HEAD_DIM ** -0.5]
        if cascade:
            call += [torch.zeros(len(lens), dtype=torch.int32),
                     torch.full((len(lens),), shared_blocks * BLOCK, dtype=torch.int32)]
        call[1:3] = caches[0]
        error = (kernel(*call).double() - reference(q, *caches[0], tables, lens)).abs().max().item()
        line = f"{name:34s}"
        for cold in (False, True):
            total, calls, started = 0.0, 0, time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                call[1:3] = caches[calls % LAYERS] if cold else caches[0]
                if cold:
                    junk.sum()
                began = time.perf_counter()
                kernel(*call)
                total += time.perf_counter() - began
                calls += 1
            per_call = total / calls
            line += f"  {'cold' if cold else 'hot'} {per_call * 1e6:7.1f} us (x30 {per_call * 30e3:5.2f} ms)"
        print(f"{line}  max |error| {error:.1e}")

    workload("1 request, 100 tokens", [100])
    workload("1 request, 1,000 tokens", [1000])
    workload("16 requests, 60-120 tokens", [random.Random(i).randint(60, 120) for i in range(16)])
    shared = [1008 + random.Random(i).randint(20, 90) for i in range(16)]
    workload("16 behind a shared prefix, cascade", shared, 63, cascade=True)
    workload("16 behind a shared prefix, per row", shared, 63)


if __name__ == "__main__":
    main()
