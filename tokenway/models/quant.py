"""Matmuls on GGUF-quantized weights as they are stored (csrc/quant.cpp).

A GGUF's Q4_1 weights are 5 bits a weight (Q8_0: 8.5); converted to bfloat16 they are 16, and
a decode step at one token reads every weight once, so its time is the bytes it reads.
QuantKernel keeps a weight's blocks (the converter saves them beside the float weights,
models/gguf.py) and runs y = x @ W.T on them, dequantizing each block in registers: the
weights are exactly the ones gguf-py dequantizes; a float32 model's products are float32, a
bfloat16 model's meet bfloat16 activations, or, with `activations="int8"` where the CPU has
AVX512-VNNI, activations quantized to int8 per block of 32 as llama.cpp meets its blocks (twice
the products an instruction; csrc/quant.cpp says how, bench/accuracy_bench.py what it costs).

The blocks are re-laid out once at load (relayout): rows in groups of 16, a vector lane each,
so a block's 16 scales are one load and 16 rows' sums build side by side.
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
# (bench/quant_bench.py: 0.6-0.8x of bfloat16 at 64 tokens). int8 products never do: their
# blocks beat bfloat16's GEMM on the ready weight up to 512 tokens (1.4x at 512 on gate_up), let
# alone dequantizing it for each call (4x slower at 64 tokens).
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


ROWS = 16  # rows per group: a vector lane each (csrc/quant.cpp)
ACTIVATIONS = ("int8", "dtype")


def products_for(dtype: torch.dtype, activations: str = "dtype") -> str:
    """The products a kernel computes: "int8" when asked and the CPU has AVX512-VNNI, else the
    model dtype's (bfloat16 where the CPU has AVX512-BF16, else float32)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: must be one of {ACTIVATIONS}, got {activations!r}")
    ops = _ops()
    if activations == "int8" and ops is not None and ops.has_products("int8"):
        return "int8"
    if dtype == torch.bfloat16 and ops is not None and ops.has_products("bfloat16"):
        return "bfloat16"
    return "float32"


def relayout(blocks: torch.Tensor, qtype: str, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF block rows (N, bytes per row) uint8 -> the kernel's (codes, d, m), rows in groups of 16
    (padded with zero rows). For each group and block, 32-byte lines: line e holds, row by row,
    the codes of elements 2e and 2e + 1 (Q4_1: low nibble; the high nibble has elements 16 + 2e
    and 17 + 2e; Q8_0: q + 128, a byte each). d and m: (groups, blocks, 16) fp16; Q8_0 has no m."""
    rows, num_blocks = blocks.shape[0], in_features // BLOCK
    groups = -(-rows // ROWS)
    raw = np.zeros((groups * ROWS, num_blocks, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    raw[:rows] = blocks.numpy().reshape(rows, num_blocks, _BLOCK_BYTES[qtype])
    raw = raw.reshape(groups, ROWS, num_blocks, -1)

    def scales(offset: int) -> torch.Tensor:  # (groups, ROWS, blocks) -> (groups, blocks, ROWS)
        values = np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0]
        return torch.from_numpy(np.ascontiguousarray(values.transpose(0, 2, 1)))

    if qtype == "Q4_1":
        # GGUF's byte j already holds element j (low nibble) and j + 16 (high): the lines' pairing.
        lines = raw[..., 4:].reshape(groups, ROWS, num_blocks, 8, 2)
        m = scales(2)
    else:
        codes = raw[..., 2:] ^ np.uint8(0x80)  # q + 128
        lines = codes.reshape(groups, ROWS, num_blocks, 16, 2)
        m = torch.zeros(0, dtype=torch.float16)
    codes = np.ascontiguousarray(lines.transpose(0, 2, 3, 1, 4)).reshape(groups, -1)  # (g, blocks, line, row, 2)
    return torch.from_numpy(codes), scales(0), m


class QuantKernel:
    """y = x @ weight.T (+ bias), float32 out, for x (T, in_features), on quantized blocks.
    The same call as models/linear.LinearKernel, which it replaces for a quantized weight."""

    __slots__ = ("qtype", "in_features", "out_features", "codes", "d", "m", "bias", "products", "gemm_dtype", "_ops")

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, activations: str = "dtype") -> None:
        if not supports(qtype, in_features):
            raise ValueError(f"no quantized kernel for {qtype} with {in_features} input features")
        ops = _ops()
        if ops is None:
            raise RuntimeError("the native quant kernel is not built on this machine")
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.codes, self.d, self.m = relayout(blocks, qtype, in_features)
        self.bias = bias  # the module's Parameter: loading fills it after this kernel exists
        # A bfloat16 model's products in bfloat16 (twice the float32 rate where the CPU has
        # AVX512-BF16), int8 ones twice that again (AVX512-VNNI).
        self.products = products_for(dtype, activations)
        # Long prompt chunks: torch's GEMM on the dequantized weight, in the model's dtype.
        self.gemm_dtype = torch.bfloat16 if products_for(dtype) == "bfloat16" else torch.float32
        self._ops = ops

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.d.nbytes + self.m.nbytes

    @property
    def bits(self) -> int:
        return 4 if self.qtype == "Q4_1" else 8

    @property
    def bias_or_none(self) -> torch.Tensor | None:
        return self.bias if self.bias is not None and self.bias.numel() else None

    def reads_blocks(self, num_rows: int) -> bool:
        """True when num_rows tokens run on the blocks as they are (quant_linear), False when on
        torch's GEMM over the dequantized weight."""
        return num_rows <= GEMM_ROWS or self.products == "int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias_or_none
        num_rows = x.shape[0]
        if self.reads_blocks(num_rows):
            return self._ops.quant_linear(x, self.codes, self.d, self.m, self.out_features, self.bits, self.products,
                                          bias)
        dtype = self.gemm_dtype
        weight = self._dequantize(dtype)
        # Token counts padded to a bucket: oneDNN keeps a primitive per shape (models/linear.py).
        out = F.linear(bucket_rows(x.to(dtype)), weight, None if bias is None else bias.to(dtype))
        return out[:num_rows].float()

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._ops.dequantize(self.codes, self.d, self.m, self.out_features, self.in_features, self.bits, dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out_features, in_features) these blocks stand for."""
        return self._dequantize(torch.float32)
