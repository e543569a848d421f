"""Dense matmuls on GGUF blocks as the file stores them (csrc/experts.cpp raw_linear).

models/quant.QuantKernel relays a weight once at load for its 16-row tiles and reads Q4_0 to
Q6_K. This kernel reads llama.cpp's blocks in place, rows as the file maps them, with the same
int8 products the expert kernel uses, and so covers the types that kernel does not: Q2_K, Q3_K,
IQ4_NL, IQ4_XS and MXFP4 (and Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16 as well), and a
safetensors checkpoint's bfloat16 and float16 weights where the model computes in float32
(models/weights.py quantized_weights(floats_as_stored)): mapped, never expanded.
Activations are quantized to int8 per block of 32 (per super-block of 256 for the K-quants and
IQ4_XS), as llama.cpp pairs them; float weights meet float32 activations.

    blocks  uint8 (N, bytes a row)   a 2-D GGUF weight as stored (a float one's bytes)
    x       (T, in_features) float   ->   y (T, N) float32
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from tokenway import native
from tokenway.models import dequant
from tokenway.models.expert_kernels import FLOAT_DTYPES, NATIVE_QTYPE_IDS, SPLIT_SCALES

QTYPES = tuple(q for q in NATIVE_QTYPE_IDS if q not in SPLIT_SCALES)  # a GGUF's: scales in the blocks


def _ops(isa: str | None = None):
    return native.load("experts", isa)


def available(isa: str | None = None) -> bool:
    """The kernel built here (any path: the plain one is slow but exact)."""
    return _ops(isa) is not None


def supports(qtype: str, in_features: int) -> bool:
    return qtype in QTYPES and in_features % dequant.block_size(qtype) == 0


# Tokens from which a float weight (BF16, F16, F32) meets x through torch's matmul instead, its
# rows converted to float32 a slice at a time into a buffer kept for the next call: from here the
# BLAS sgemm outruns the raw kernel's register tiles by more than the conversion costs (Zen 1,
# 4096 x 2880 bfloat16: 128 tokens 144 ms raw, 112 ms sgemm + 7 ms converting).
FLOAT_MATMUL_TOKENS = 128
_FLOAT_SLICE_BYTES = 64 * 2**20  # float32 bytes of rows converted at once
_scratch = threading.local()  # .rows: a float32 buffer of up to _FLOAT_SLICE_BYTES, this thread's


def _float_rows(weight: torch.Tensor) -> torch.Tensor:
    """weight (rows, in_features) of a float dtype as float32, in this thread's reused buffer (a
    fresh one would fault in its pages on every call: three times the conversion's own time)."""
    count = weight.numel()
    rows = getattr(_scratch, "rows", None)
    if rows is None or rows.numel() < count:
        rows = _scratch.rows = torch.empty(max(count, _FLOAT_SLICE_BYTES // 4))
    return rows[:count].view(weight.shape).copy_(weight)


class RawQuantKernel:
    """y = x @ weight.T (+ bias), float32 out, for x (T, in_features), on the GGUF blocks in place.
    The call models/quant.QuantKernel has. isa: a build for another instruction set (tests)."""

    __slots__ = ("_ops", "bias", "in_features", "out_features", "products", "qtype", "qtype_id", "weight")

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        if not supports(qtype, in_features):
            raise ValueError(f"no raw-block kernel for {qtype} with {in_features} input features")
        block_size, type_size = dequant.block_sizes(qtype)
        row_bytes = in_features // block_size * type_size
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{qtype} weight of {in_features} input features: expected uint8 blocks (N, {row_bytes}), "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        ops = _ops(isa)
        if ops is None:
            raise RuntimeError("the native experts kernel is not built on this machine")
        self.qtype = qtype
        self.qtype_id = NATIVE_QTYPE_IDS[qtype]
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.weight = blocks.contiguous()  # a mapped GGUF tensor is contiguous: no copy
        self.bias = bias  # the module's Parameter: loading may fill it after this kernel exists
        self.products = "float32" if qtype in FLOAT_DTYPES else "int8"
        self._ops = ops

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def bias_or_none(self) -> torch.Tensor | None:
        return self.bias if self.bias is not None and self.bias.numel() else None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a float32 (T, out_features) view to write into (rows may be further apart: a column
        slice of a wider output), returned."""
        if self.qtype in FLOAT_DTYPES and x.shape[0] >= FLOAT_MATMUL_TOKENS:
            return self._float_matmul(x, out)
        if out is None:
            return self._ops.raw_linear(x, self.weight, self.qtype_id, self.bias_or_none)
        self._ops.raw_linear_out(x, self.weight, self.qtype_id, self.bias_or_none, out)
        return out

    def _float_matmul(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        x = x.float()
        weight = self.weight.view(FLOAT_DTYPES[self.qtype])  # (out_features, in_features)
        bias = self.bias_or_none
        step = max(1, _FLOAT_SLICE_BYTES // (4 * self.in_features))
        for r0 in range(0, self.out_features, step):
            rows = slice(r0, min(self.out_features, r0 + step))
            out[:, rows] = F.linear(x, _float_rows(weight[rows]), None if bias is None else bias[rows].float())
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out_features, in_features), exactly as gguf-py dequantizes it."""
        return dequant.dequantize(self.weight, self.qtype, (self.out_features, self.in_features))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (1-D integers) of the weight as float32 (len(ids), in_features), decoded from
        their blocks alone (models/dequant.py, bit-equal to gguf-py)."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"ids: a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.out_features):
            raise ValueError(f"ids: out of range for {self.out_features} rows")
        return dequant.dequantize_rows(self.weight, self.qtype, (self.out_features, self.in_features), ids)
