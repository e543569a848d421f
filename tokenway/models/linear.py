"""Linear layers by whichever CPU GEMM is fastest for their weight on this machine.

PyTorch's CPU F.linear goes to the BLAS it was built with (MKL on x86). That is not always
the fast one: on a 2-core AMD EPYC (AVX2) MKL ran SmolLM2's 3072x576 gate/up at 4 tokens in
1.9 ms where oneDNN, with the weight reordered once into its blocked layout, took 0.37 ms, and
the 49,152-row head at one token in 11.4 ms against 6.0 ms; while for a 576x576 weight at one
token MKL was twice as fast. The CPU changes between machines, so the choice is measured at
load, per weight shape, at 1, 4 and 16 tokens (`select_kernels`), and each weight keeps one
layout only: packing replaces the plain copy, so weights take no more memory.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

BATCH_SIZES = (1, 4, 16)
# oneDNN keeps a compiled primitive per input shape (ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by
# default), and a step's token count takes any value up to max_num_batched_tokens: with every
# count its own shape, RSS grew ~20 MiB a minute under steady load (bench/soak.py). Token counts
# above ROW_BUCKET are padded up to a multiple of it, so each weight sees at most
# ROW_BUCKET + max_num_batched_tokens / ROW_BUCKET shapes.
ROW_BUCKET = 16
# Weight dtypes whose CPU matmuls torch hands to oneDNN (float32 goes to MKL).
ONEDNN_DTYPES = (torch.bfloat16, torch.float16)
# A packed layout must beat the default by this much (summed relative time over BATCH_SIZES)
# to be chosen, so that near ties keep the default and the choice is stable between starts.
MARGIN = 0.10


class LinearKernel:
    """y = x @ weight.T (+ bias), float32 out, for x (T, in_features)."""

    __slots__ = ("weight", "bias", "packed", "packed_bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # the module's Parameter: loading fills it in place
        self.bias = bias
        self.packed: torch.Tensor | None = None  # oneDNN blocked layout (fp32, CPU) when chosen
        self.packed_bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            num_rows = x.shape[0]
            x = bucket_rows(x.float())
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.packed_bias, "none", [], "")
            return out[:num_rows]
        if self.weight.dtype in ONEDNN_DTYPES and self.weight.device.type == "cpu":
            # torch runs bf16/fp16 CPU matmuls through oneDNN, which caches a primitive, with
            # its own reordered copy of the weight, per input shape (~0.7 MiB per token count
            # for a 1536x576 bf16 weight): bucketed like the packed path.
            num_rows = x.shape[0]
            return F.linear(bucket_rows(x.to(self.weight.dtype)), self.weight, self.bias)[:num_rows].float()
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()

    @property
    def backend(self) -> str:
        return "onednn" if self.packed is not None else "default"

    def pack(self, packed: torch.Tensor | None = None) -> None:
        """Switch to oneDNN's layout (packed: this weight already packed); the plain weight's storage is released."""
        self.packed = pack_weight(self.weight.data) if packed is None else packed
        self.packed_bias = None if self.bias is None else self.bias.data.float()
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)


def bucket_rows(x: torch.Tensor) -> torch.Tensor:
    """x with its rows padded (zeros) up to the next multiple of ROW_BUCKET when above it."""
    num_rows = x.shape[0]
    if num_rows <= ROW_BUCKET or num_rows % ROW_BUCKET == 0:
        return x
    return F.pad(x, (0, 0, 0, ROW_BUCKET - num_rows % ROW_BUCKET))


def onednn_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), max(BATCH_SIZES))


def median_time(fn, x: torch.Tensor, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn(x) over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn(x)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure(weight: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """(default, onednn) summed time relative to the faster of the two at each batch size, and
    the packed weight (so the kernel measured need not be packed again)."""
    trial = LinearKernel(weight)
    packed = LinearKernel(weight)
    packed.packed = pack_weight(weight)
    default_score = onednn_score = 0.0
    for batch in BATCH_SIZES:
        x = torch.randn(batch, weight.shape[1])
        default_time, onednn_time = median_time(trial, x), median_time(packed, x)
        best = min(default_time, onednn_time)
        default_score += default_time / best
        onednn_score += onednn_time / best
    return default_score, onednn_score, packed.packed


@torch.inference_mode()
def select_kernels(kernels: list[LinearKernel], mode: str = "auto") -> dict[tuple[int, int], str]:
    """Choose each kernel's layout. mode: "auto" (measure), "default" or "onednn".
    Returns {weight shape: backend} for the log line."""
    chosen: dict[tuple[int, int], str] = {}
    for kernel in kernels:
        weight = kernel.weight.data
        rows, cols = weight.shape  # 2-D: (out_features, in_features)
        shape = (rows, cols)
        packed = None
        if not onednn_available(weight) or mode == "default":
            chosen.setdefault(shape, "default")
        elif shape not in chosen:
            if mode == "onednn":
                chosen[shape] = "onednn"
            else:
                default_score, onednn_score, packed = measure(weight)
                chosen[shape] = "onednn" if onednn_score * (1 + MARGIN) < default_score else "default"
        if chosen[shape] == "onednn":
            kernel.pack(packed)
    return chosen
