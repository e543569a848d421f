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

Several layers (--layers, > 1 GB in all by default) are called in turn with fresh random routing
each step, as a decode pass streams its layers: the weights come from memory, not from L3 (300
MiB here). "MB a step": the bytes of the distinct experts the step's tokens chose (gate, up and
down). "GB/s": those bytes over the step's best time. "plain": torch.sum over a float32 buffer
of all layers' bytes (best of 5, the same threads): the speed a kernel that only streamed its
weights would reach. "of read": GB/s over plain.
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


def plain_read_gbs(num_bytes: int) -> float:
    buffer = torch.zeros(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(6):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def bench(shape: Shape, kernels: list[NativeExpertKernel], tokens: int, repeats: int) -> tuple[float, float]:
    """(seconds, MB read) of the step that read fastest (the cores are shared: the best step
    measures the kernel, a preempted one the scheduler), layers called in turn, fresh routing."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=gen)
    best = (float("inf"), 1.0)
    for step in range(repeats + 2):
        ids = torch.stack([torch.randperm(shape.num_experts, generator=gen)[:shape.top_k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, shape.top_k, generator=gen), -1)
        kernel = kernels[step % len(kernels)]
        started = time.perf_counter()
        kernel(x, ids, weights)
        elapsed = time.perf_counter() - started
        read = len(torch.unique(ids)) * expert_bytes(kernel) / 1e6
        if step >= 2 and elapsed / read < best[0] / best[1]:
            best = (elapsed, read)
    return best


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
        plain = plain_read_gbs(total)
        print(f"\n{name}: {shape}; {shape.layers} layers, {total / 1e9:.2f} GB of experts; "
              f"plain {torch.get_num_threads()}-thread read {plain:.1f} GB/s")
        print(f"{'isa':7s} {'T':>4s} {'ms a step':>9s} {'MB a step':>9s} {'GB/s':>6s} {'of read':>7s}")
        for isa in args.isas.split(","):
            kernels = [NativeExpertKernel(g, u, d, spec, *b, isa=None if isa == "native" else isa)
                       for g, u, d, b in layers]
            for tokens in (int(t) for t in args.tokens.split(",")):
                repeats = args.repeats if tokens < 64 else max(4, args.repeats // 6)
                seconds, mb = bench(shape, kernels, tokens, repeats)
                gbs = mb / 1e3 / seconds
                print(f"{isa:7s} {tokens:4d} {seconds * 1e3:9.3f} {mb:9.1f} {gbs:6.1f} {gbs / plain:7.0%}", flush=True)


if __name__ == "__main__":
    main()
