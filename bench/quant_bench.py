"""One matmul per weight shape of the default model: GGUF blocks (models/quant.py) against the
float kernels the engine would otherwise use, at 1, 4, 16 and 64 tokens.

    python bench/quant_bench.py
    python bench/quant_bench.py --tokens 1,16 --repeats 200

Columns: the median time (ms) of y = x @ W.T for each kernel (blocks with float32, bfloat16 or
int8 products), the best blocks kernel against bfloat16, and the bytes of weight each reads.
bfloat16 and float32 run through models/linear.LinearKernel as the engine runs them (oneDNN
packing chosen by measurement for float32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway.config import DEFAULT_MODEL  # noqa: E402
from tokenway.models import quant  # noqa: E402
from tokenway.models.linear import LinearKernel, median_time, select_kernels  # noqa: E402
from tokenway.models.loader import quantized_weights, resolve_model  # noqa: E402

SHAPES = {  # name in the checkpoint -> what it is in a layer
    "model.layers.0.self_attn.q_proj.weight": "q (of qkv)",
    "model.layers.0.self_attn.o_proj.weight": "o",
    "model.layers.0.mlp.gate_proj.weight": "gate (of gate_up)",
    "model.layers.0.mlp.down_proj.weight": "down",
    "model.embed_tokens.weight": "head (tied)",
}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not quant.available():
        raise SystemExit("the quant kernel has no vector path on this CPU (AVX512-VNNI)")
    kept = quantized_weights(resolve_model(args.model))
    token_counts = [int(n) for n in args.tokens.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'weight':20s} {'shape':>11s} {'type':5s} {'T':>3s} {'blocks fp32':>11s} {'blocks bf16':>11s} "
          f"{'blocks int8':>11s} {'bf16 ms':>8s} {'fp32 ms':>8s} {'vs bf16':>8s}  bytes blocks/bf16")
    for name, label in SHAPES.items():
        tensor = kept[name]
        kernel = quant.QuantKernel(tensor.blocks, tensor.qtype, tensor.shape[1])
        kernel_bf16 = quant.QuantKernel(tensor.blocks, tensor.qtype, tensor.shape[1], dtype=torch.bfloat16)
        kernel_int8 = quant.QuantKernel(tensor.blocks, tensor.qtype, tensor.shape[1], dtype=torch.bfloat16,
                                        activations="int8")
        weight = kernel.dequantize()
        bf16 = LinearKernel(weight.bfloat16())
        fp32 = LinearKernel(weight.clone())
        select_kernels([fp32])
        for tokens in token_counts:
            x = torch.randn(tokens, tensor.shape[1])
            times = [median_time(fn, x, args.repeats, warmup=3) * 1e3
                     for fn in (kernel, kernel_bf16, kernel_int8, bf16, fp32)]
            print(f"{label:20s} {tensor.shape[0]:5d}x{tensor.shape[1]:<5d} {tensor.qtype:5s} {tokens:3d} "
                  f"{times[0]:11.3f} {times[1]:11.3f} {times[2]:11.3f} {times[3]:8.3f} {times[4]:8.3f} "
                  f"{times[3] / min(times[:3]):7.2f}x  "
                  f"{kernel.nbytes / 2**20:.2f}/{weight.numel() * 2 / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
