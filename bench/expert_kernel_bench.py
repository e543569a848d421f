"""The native expert kernel (models/expert_kernels.NativeExpertKernel, csrc/experts.cpp) at real
MoE layer shapes: how close one step comes to reading the weight bytes it needs at the machine's
memory speed, beside a plain read of as many bytes by the same threads, measured in the same run.

    python bench/expert_kernel_bench.py
    python bench/expert_kernel_bench.py --models qwen3 --tokens 1 --repeats 50 --isas native,avx2

Models (one layer's experts, random valid blocks: random bytes with small fp16 scales, MXFP4 a
small E8M0 scale; the speed of a block kernel does not depend on the values):
- qwen3: Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768, Q4_K gate and
  up, Q6_K down (its Q4_K_M file), silu.
- gptoss: gpt-oss-20b: 32 experts, top-4, hidden 2880, intermediate 2880, MXFP4 gate, up and
  down, swiglu_oai with biases.

Several layers (> 1 GB in all) are called in turn with fresh random routing each step, as a
decode pass streams its layers, each step after a 512 MiB read: the weights come from memory, not
from L3 (300 MiB here). "MB a step": the bytes of the distinct experts the step's tokens chose
(gate, up and down). "GB/s": those bytes over the step's time. "plain GB/s": a plain C++ read
(csrc/experts.cpp plain_read) of as many bytes by the same threads, after the same 512 MiB read, timed beside
every step: the speed a kernel that only streamed its weights would reach. Both the best of
--repeats (the cores are shared). "of read": GB/s over plain.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf

from tokenway import native
from tokenway.models.expert_kernels import ExpertSpec, ExpertWeights, NativeExpertKernel


@dataclass(frozen=True)
class Shape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    gate_up: str
    down: str
    activation: str
    biased: bool
    layers: int  # layers cycled: weights past L3


MODELS = {
    "qwen3": Shape(128, 8, 2048, 768, "Q4_K", "Q6_K", "silu", False, 4),
    "gptoss": Shape(32, 4, 2880, 2880, "MXFP4", "MXFP4", "swiglu_oai", True, 3),
}
F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def random_experts(num_experts: int, rows: int, cols: int, qtype: str, rng: np.random.Generator) -> ExpertWeights:
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (num_experts, rows, cols // block_size, type_size), dtype=np.uint8)
    if qtype == "MXFP4":
        blocks[..., 0] = rng.integers(118, 124, blocks.shape[:-1], dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, ()):
        scales = rng.uniform(1e-3, 1e-2, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:-1], 2)
    return ExpertWeights(qtype, torch.from_numpy(blocks.reshape(num_experts, rows, -1)), (num_experts, rows, cols))


def expert_bytes(kernel: NativeExpertKernel) -> int:
    return sum(w.blocks[0].numel() for w in (kernel.gate, kernel.up, kernel.down))


def read_plainly(buffer: torch.Tensor) -> None:
    """Every byte of buffer read once by the pool's threads (csrc/experts.cpp plain_read: 8-byte
    words summed, vectorized): a plain read in C++, faster than any torch reduction here."""
    native.load("experts").plain_read(buffer)


FLUSH_BYTES = 512 << 20  # read between timed calls: past L3 (300 MiB here), so weights come from memory


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def bench(shape: Shape, kernels: list[NativeExpertKernel], tokens: int, repeats: int,
          flush: torch.Tensor, plain: torch.Tensor) -> tuple[float, float, float]:
    """(seconds, MB read, plain-read seconds of as many bytes) of the step that read fastest,
    and the fastest plain read (the cores are shared: the best of each measures the work, a
    preempted one the scheduler). Each step: fresh routing, the next layer, after a read of
    FLUSH_BYTES; each plain read after one too."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=gen)
    best, best_plain = (float("inf"), 1.0), float("inf")
    for step in range(repeats + 1):
        ids = torch.stack([torch.randperm(shape.num_experts, generator=gen)[:shape.top_k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, shape.top_k, generator=gen), -1)
        kernel = kernels[step % len(kernels)]
        read = len(torch.unique(ids)) * expert_bytes(kernel)
        read_plainly(flush)
        elapsed = timed(kernel, x, ids, weights)
        read_plainly(flush)
        plain_elapsed = timed(read_plainly, plain[:read])
        if step >= 1:
            best = min(best, (elapsed, read / 1e6), key=lambda pair: pair[0] / pair[1])
            best_plain = min(best_plain, plain_elapsed / read)
    return best[0], best[1], best_plain * best[1] * 1e6


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3,gptoss")
    parser.add_argument("--tokens", default="1,16,512")
    parser.add_argument("--isas", default="native")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        shape = MODELS[name]
        spec = ExpertSpec(shape.activation)
        layers = []
        for _ in range(shape.layers):
            gate = random_experts(shape.num_experts, shape.inter, shape.hidden, shape.gate_up, rng)
            up = random_experts(shape.num_experts, shape.inter, shape.hidden, shape.gate_up, rng)
            down = random_experts(shape.num_experts, shape.hidden, shape.inter, shape.down, rng)
            biases = (tuple(torch.randn(shape.num_experts, n) * 0.1 for n in (shape.inter, shape.inter, shape.hidden))
                      if shape.biased else (None, None, None))
            layers.append((gate, up, down, biases))
        total = sum(w.blocks.numel() for gate, up, down, _ in layers for w in (gate, up, down))
        flush = torch.ones(FLUSH_BYTES, dtype=torch.uint8)
        plain = torch.ones(total // shape.layers, dtype=torch.uint8)  # a layer's bytes: a step reads at most these
        print(f"\n{name}: {shape.num_experts} experts, top-{shape.top_k}, hidden {shape.hidden}, intermediate "
              f"{shape.inter}, {shape.gate_up} gate/up, {shape.down} down, {shape.activation}; {shape.layers} layers, "
              f"{total / 1e9:.2f} GB of experts")
        print(f"{'isa':7s} {'T':>4s} {'ms a step':>9s} {'MB a step':>9s} {'GB/s':>6s} {'plain GB/s':>10s} "
              f"{'of read':>7s}")
        for isa in args.isas.split(","):
            kernels = [NativeExpertKernel(g, u, d, spec, *b, isa=None if isa == "native" else isa)
                       for g, u, d, b in layers]
            for tokens in (int(t) for t in args.tokens.split(",")):
                repeats = args.repeats if tokens < 64 else max(4, args.repeats // 6)
                seconds, mb, plain_seconds = bench(shape, kernels, tokens, repeats, flush, plain)
                gbs, plain_gbs = mb / 1e3 / seconds, mb / 1e3 / plain_seconds
                print(f"{isa:7s} {tokens:4d} {seconds * 1e3:9.3f} {mb:9.1f} {gbs:6.1f} {plain_gbs:10.1f} "
                      f"{gbs / plain_gbs:7.0%}", flush=True)

if __name__ == "__main__":
    main()
