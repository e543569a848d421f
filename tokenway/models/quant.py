"""Matmuls on GGUF-quantized weights as they are stored (csrc/quant.cpp).

A GGUF's Q4_1 weights are 5 bits a weight (Q8_0: 8.5); converted to bfloat16 they are 16, and
a decode step at one token reads every weight once, so its time is the bytes it reads.
QuantKernel keeps a weight's blocks (the converter saves them beside the float weights,
models/gguf.py) and runs y = x @ W.T on them, dequantizing each block in registers: the
products are the float model's, in float32.

The blocks are re-laid out once at load into codes (one byte per two Q4_1 weights, one signed
byte per Q8_0 weight) and per-block fp16 scale d and offset m (Q4_1: w = d * q + m; Q8_0:
w = d * q, m = 0), so the kernel reads three dense streams.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenway import native
from tokenway.models.linear import bucket_rows

# GGUF block types the kernel reads directly.
QTYPES = ("Q4_1", "Q8_0")
BLOCK = 32
# Above this many tokens (prompt chunks) a weight is dequantized for the call and multiplied by
# torch's GEMM (oneDNN for bfloat16, MKL for float32): their blocked kernels reuse each weight
# across many tokens, where the block kernel dequantizes each block once per 8-token tile
# (bench/quant_bench.py: 0.6-0.8x of bfloat16 at 64 tokens).
GEMM_ROWS = 48
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def _ops():
    return native.load("quant")


def available() -> bool:
    """The kernel built, with its vector path (AVX512): the scalar one is for tests."""
    ops = _ops()
    return ops is not None and bool(ops.fast())


def supports(qtype: str, in_features: int) -> bool:
    return qtype in QTYPES and in_features % BLOCK == 0


def relayout(blocks: torch.Tensor, qtype: str, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF block rows (N, bytes per row) uint8 -> (codes uint8, d fp16, m fp16)."""
    num_blocks = in_features // BLOCK
    raw = blocks.numpy().reshape(blocks.shape[0], num_blocks, _BLOCK_BYTES[qtype])
    d = np.ascontiguousarray(raw[:, :, 0:2]).view(np.float16).reshape(-1, num_blocks)
    if qtype == "Q4_1":
        m = np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16).reshape(-1, num_blocks)
        codes = raw[:, :, 4:].reshape(-1, num_blocks * 16)
    else:
        m = np.zeros_like(d)
        codes = raw[:, :, 2:].reshape(-1, in_features)  # int8 bits
    return (torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(d)),
            torch.from_numpy(np.ascontiguousarray(m)))


class QuantKernel:
    """y = x @ weight.T (+ bias), float32 out, for x (T, in_features), on quantized blocks.
    The same call as models/linear.LinearKernel, which it replaces for a quantized weight."""

    __slots__ = ("qtype", "in_features", "codes", "d", "m", "bias", "bf16", "_ops")

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        if not supports(qtype, in_features):
            raise ValueError(f"no quantized kernel for {qtype} with {in_features} input features")
        ops = _ops()
        if ops is None:
            raise RuntimeError("the native quant kernel is not built on this machine")
        self.qtype = qtype
        self.in_features = in_features
        self.codes, self.d, self.m = relayout(blocks, qtype, in_features)
        self.bias = bias  # the module's Parameter: loading fills it after this kernel exists
        # A bfloat16 model's products in bfloat16 (twice the float32 rate where the CPU has AVX512-BF16).
        self.bf16 = dtype == torch.bfloat16 and bool(ops.has_bf16())
        self._ops = ops

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.d.nbytes + self.m.nbytes

    @property
    def bits(self) -> int:
        return 4 if self.qtype == "Q4_1" else 8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is not None and self.bias.numel() else None
        num_rows = x.shape[0]
        if num_rows <= GEMM_ROWS:
            return self._ops.quant_linear(x, self.codes, self.d, self.m, self.bits, self.bf16, bias)
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        weight = self._ops.dequantize(self.codes, self.d, self.m, self.bits, dtype)
        # Token counts padded to a bucket: oneDNN keeps a primitive per shape (models/linear.py).
        out = F.linear(bucket_rows(x.to(dtype)), weight, None if bias is None else bias.to(dtype))
        return out[:num_rows].float()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out_features, in_features) these blocks stand for."""
        num_blocks = self.in_features // BLOCK
        if self.qtype == "Q4_1":
            packed = self.codes.view(-1, num_blocks, 16)
            q = torch.cat([packed & 15, packed >> 4], dim=-1)
        else:
            q = self.codes.view(torch.int8).view(-1, num_blocks, BLOCK)
        w = q.float() * self.d.float().unsqueeze(-1) + self.m.float().unsqueeze(-1)
        return w.reshape(-1, self.in_features)
