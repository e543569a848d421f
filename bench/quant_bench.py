"""GGUF block kernels (models/quant.py) per block type: how close a matmul comes to reading its
weight bytes at the machine's memory speed, the decode goal (T = 1: >= 90% of a plain read).

    python bench/quant_bench.py
    python bench/quant_bench.py --types Q4_K,Q6_K --tokens 1 --isas native --repeats 200
    python bench/quant_bench.py --types Q4_K,Q5_K,Q6_K --tokens 1,16,64,512 --shapes 16384x2048,2048x8192

--shapes: weights N x K (out x in features); the defaults are SmolLM2-1.7B's o and gate
projections, the last example's Llama-3.2-1B's gate_up and down.

For each type, weight shape (N x K) and token count T: the best time of y = x @ W.T on the
blocks with int8 products (a bfloat16 model's default) and float32 products (a float32
model's), the weight bytes it reads per second, and that as a share of a plain read of the same
number of bytes by the same threads, measured in the same run (torch.sum over a float32 buffer
of that size: the bandwidth a kernel that only streams its weight could reach, from whichever
cache level the weight fits in: repeated calls find a 9 MiB weight in L3). "from memory" rows:
T = 1 with the weight streamed from memory, as in a decode step (copies of it, 256 MiB in all,
called in turn, against a plain read of as many bytes). bf16 GEMM: torch's F.linear on the dequantized weight in
bfloat16 (oneDNN), the kernel the engine would run on float weights. Rows per ISA build: this
CPU's own and a forced AVX2 one (native.ISA_FLAGS), side by side in one process. The weights
are random valid blocks: the speed of a block kernel does not depend on the values.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf

from tokenway.models import quant

SHAPES = "2048x2048,8192x2048"
MEMORY_BYTES = 256 << 20  # past any L3: weights cycled through this many bytes stream from memory


def best_time(fn, x, repeats: int) -> float:
    """The fastest of `repeats` calls, after 3 untimed: the cores are shared, and a call the OS
    preempts measures the scheduler (the median often did), not the kernel."""
    for _ in range(3):
        fn(x)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - started)
    return best


def random_blocks(rows: int, cols: int, qtype: str) -> torch.Tensor:
    """Random bytes with fp16 scales (d, and m or dmin) in [1e-3, 1e-2]: valid blocks of any type."""
    rng = np.random.default_rng(0)
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, cols // block_size, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[..., 208:210] = scales[..., :2]
    else:  # d and m or dmin (for Q4_0, Q5_0 and Q8_0 the second pair is codes, as valid)
        blocks[..., 0:4] = scales
    return torch.from_numpy(blocks.reshape(rows, -1))


def plain_read_seconds(num_bytes: int, repeats: int) -> float:
    """A plain read of num_bytes by torch's threads: the bandwidth baseline."""
    buffer = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32)
    return best_time(lambda b: b.sum(), buffer, repeats)


def from_memory(kernel: quant.QuantKernel, repeats: int) -> tuple[float, float]:
    """(seconds a T = 1 matmul takes, seconds a plain read of its bytes takes) with the weight
    read from memory: copies of it, MEMORY_BYTES in all, called in turn, as a decode step
    streams its layers."""
    copies = [kernel.weight.clone() for _ in range(max(2, MEMORY_BYTES // kernel.nbytes))]
    x = torch.randn(1, kernel.in_features)

    def cycle(x):
        for weight in copies:
            kernel._ops.quant_linear(x, weight, kernel.out_features, kernel.qtype_id, kernel.products, None)

    total = best_time(cycle, x, max(3, repeats // 10)) / len(copies)
    return total, plain_read_seconds(kernel.nbytes * len(copies), max(3, repeats // 10)) / len(copies)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(quant.QTYPES))
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--isas", default="native,avx2")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    qtypes = args.types.split(",")
    token_counts = [int(n) for n in args.tokens.split(",")]
    isas = [None if isa == "native" else isa for isa in args.isas.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    gguf_sizes = {q: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]] for q in qtypes}  # (block, bytes)
    print("bytes a weight, relaid (GGUF): " + ", ".join(
        f"{q} {quant.bytes_per_weight(q):.3f} ({gguf_sizes[q][1] / gguf_sizes[q][0]:.3f})" for q in qtypes))
    big = 1 << 30
    print(f"plain read of 1 GiB (memory): {big / plain_read_seconds(big, 5) / 1e9:.1f} GB/s")
    print(f"{'isa':9s} {'type':5s} {'shape':>10s} {'MiB':>6s} {'T':>4s} {'int8 ms':>8s} {'GB/s':>6s} {'of read':>7s} "
          f"{'fp32 ms':>8s} {'GB/s':>6s} {'of read':>7s} {'read ms':>8s} {'bf16 GEMM ms':>12s}")
    for isa in isas:
        if not quant.available(isa):
            print(f"{isa}: no vector build on this machine")
            continue
        name = quant._ops(isa).isa()
        for qtype in qtypes:
            for rows, cols in shapes:
                blocks = random_blocks(rows, cols, qtype)
                int8 = quant.QuantKernel(blocks, qtype, cols, dtype=torch.bfloat16, activations="int8", isa=isa)
                fp32 = quant.QuantKernel(blocks, qtype, cols, isa=isa)
                weight = fp32.dequantize().bfloat16()
                read = plain_read_seconds(int8.nbytes, args.repeats)
                for tokens in token_counts:
                    x = torch.randn(tokens, cols)
                    # the blocks at any T (past GEMM_ROWS float32 products would multiply the dequantized weight)
                    on_blocks = [
                        lambda x, k=k: k._ops.quant_linear(x, k.weight, k.out_features, k.qtype_id, k.products, None)
                        for k in (int8, fp32)]
                    t_int8, t_fp32 = (best_time(fn, x, args.repeats) for fn in on_blocks)
                    t_bf16 = best_time(lambda x, w=weight: F.linear(x.bfloat16(), w), x, max(5, args.repeats // 5))
                    gbs = [int8.nbytes / t / 1e9 for t in (t_int8, t_fp32)]
                    print(f"{name:9s} {qtype:5s} {rows:5d}x{cols:<4d} {int8.nbytes / 2**20:6.2f} {tokens:4d} "
                          f"{t_int8 * 1e3:8.3f} {gbs[0]:6.1f} {read / t_int8:6.0%} "
                          f"{t_fp32 * 1e3:8.3f} {gbs[1]:6.1f} {read / t_fp32:6.0%} "
                          f"{read * 1e3:8.3f} {t_bf16 * 1e3:12.3f}")
                memory = [from_memory(kernel, args.repeats) for kernel in (int8, fp32)]
                print(f"{name:9s} {qtype:5s} {rows:5d}x{cols:<4d} {'from memory':>11s} {memory[0][0] * 1e3:8.3f} "
                      f"{int8.nbytes / memory[0][0] / 1e9:6.1f} {memory[0][1] / memory[0][0]:6.0%} "
                      f"{memory[1][0] * 1e3:8.3f} {int8.nbytes / memory[1][0] / 1e9:6.1f} "
                      f"{memory[1][1] / memory[1][0]:6.0%} {memory[0][1] * 1e3:8.3f}")


if __name__ == "__main__":
    main()
