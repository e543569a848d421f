"""Matmuls on GGUF-quantized weights as they are stored (csrc/quant.cpp).

A GGUF's Q4_K weights are 4.5 bits a weight (Q8_0: 8.5); converted to bfloat16 they are 16, and
a decode step at one token reads every weight once, so its time is the bytes it reads.
QuantKernel keeps a weight's blocks (the converter saves them beside the float weights,
models/gguf.py) and runs y = x @ W.T on them, decoding each block in registers: the weights are
exactly the ones gguf-py dequantizes; a float32 model's products are float32, a bfloat16 model's
meet bfloat16 activations, or, with `activations="int8"`, activations quantized to int8 per
block of 32 (per super-block of 256 for the K-quants) as llama.cpp meets its blocks
(csrc/quant_int8.h says how, bench/accuracy_bench.py what it costs). Vector paths: AVX512
(VNNI, BF16 where the CPU has them) and AVX2.

The blocks are re-laid out once at load (relayout; csrc/quant_format.h): rows in groups of 16,
a vector lane each, so a block's 16 scales are one load and 16 rows' sums build side by side.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from tokenway import native
from tokenway.models.linear import bucket_rows

# Above this many tokens (prompt chunks) a weight is dequantized for the call and multiplied by
# torch's GEMM (oneDNN for bfloat16, MKL for float32): their blocked kernels reuse each weight
# across many tokens, where the block kernel decodes each block once per 8-token tile
# (bench/quant_bench.py: 0.6-0.8x of bfloat16 at 64 tokens). int8 products never do: their
# blocks beat bfloat16's GEMM on the ready weight up to 512 tokens (1.4x at 512 on gate_up), let
# alone dequantizing it for each call (4x slower at 64 tokens).
GEMM_ROWS = 48
ROWS = 16  # rows per group: a vector lane each (csrc/quant_format.h)
# Bump whenever relayout's output changes: models/weights.KernelCache names its files by it.
LAYOUT_VERSION = 1
ACTIVATIONS = ("int8", "dtype")


# GGUF block types the kernel reads directly, by GGML type id (the kernel's qtype).
GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
QTYPES = tuple(GGML_TYPE_IDS)
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SUPER_BLOCK = {qtype: 256 if qtype in _K_QUANTS else 32 for qtype in QTYPES}  # weights a tile
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
_HEADER = {"Q4_0": 32, "Q4_1": 64, "Q5_0": 32, "Q5_1": 64, "Q8_0": 32, "Q4_K": 320, "Q5_K": 320, "Q6_K": 320}
_RELAYOUT_ROWS = 4096  # rows relaid at a time: bounds the numpy temporaries


def _sub_bytes(qtype: str) -> int:
    bits = _BITS[qtype]
    return 512 if bits == 8 else 256 + (bits - 4) * 64


def bytes_per_weight(qtype: str) -> float:
    """The relaid layout's bytes a weight (the GGUF's are gguf.GGML_QUANT_SIZES')."""
    tile = _HEADER[qtype] + SUPER_BLOCK[qtype] // 32 * _sub_bytes(qtype)
    return tile / (ROWS * SUPER_BLOCK[qtype])


def _unpack(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """(rows, super-blocks, block bytes) GGUF blocks -> codes (rows, super-blocks, 32-weight
    sub-blocks, 32) uint8 (Q8_0: q + 128), and the header's parts, each (rows, super-blocks, bytes
    a row): d, then m or dmin, then the K-quants' sub-block scales (and mins), as the kernel
    reads them (csrc/quant_format.h)."""
    rows, supers = raw.shape[:2]

    def nibbles(qs: np.ndarray) -> np.ndarray:  # byte i: element i (low), 16 + i (high), per 32
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    def high_bits(qh: np.ndarray) -> np.ndarray:  # 4 bytes, little-endian: bit i of element i
        return (np.unpackbits(qh, axis=-1, bitorder="little") << 4).astype(np.uint8)

    if qtype == "Q4_0":
        return nibbles(raw[..., 2:18])[:, :, None], [raw[..., 0:2]]
    if qtype == "Q4_1":
        return nibbles(raw[..., 4:20])[:, :, None], [raw[..., 0:2], raw[..., 2:4]]
    if qtype == "Q5_0":
        return (nibbles(raw[..., 6:22]) | high_bits(raw[..., 2:6]))[:, :, None], [raw[..., 0:2]]
    if qtype == "Q5_1":
        return (nibbles(raw[..., 8:24]) | high_bits(raw[..., 4:8]))[:, :, None], [raw[..., 0:2], raw[..., 2:4]]
    if qtype == "Q8_0":
        return (raw[..., 2:34] ^ np.uint8(0x80))[:, :, None], [raw[..., 0:2]]
    if qtype in ("Q4_K", "Q5_K"):
        sc, mins = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
        qs = raw[..., -128:].reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(rows, supers, 8, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
        if qtype == "Q5_K":  # bit s of byte i: bit 4 of sub-block s's element i
            qh = raw[..., 16:48].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            codes |= (qh & 1) << 4
        scales = [sc.reshape(rows, supers, 8), mins.reshape(rows, supers, 8)]
        return codes, [raw[..., 0:2], raw[..., 2:4], *scales]
    # Q6_K: ql (128), qh (64), scales (16, int8), d; element 128h + 64s + i: ql[64h + i] >> 4s,
    # its high bits (qh[32h + i'] >> 2s') & 3 for element 128h + 32s' + i'.
    ql = raw[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = (raw[..., 128:192].reshape(rows, supers, 2, 1, 32)
          >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1))
    codes = (ql & 0x0F).reshape(rows, supers, 8, 32) | ((qh & 3) << 4).reshape(rows, supers, 8, 32)
    padding = np.zeros((rows, supers, 2), dtype=np.uint8)
    return codes, [raw[..., 208:210], padding, raw[..., 192:208]]


def _planes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes (..., 16 rows, 32) -> the sub-block's bytes (..., sub bytes): csrc/quant_format.h."""
    lead = codes.shape[:-2]
    if bits == 8:  # vector j: byte 4r + i = element 4j + i
        return codes.reshape(*lead, 16, 8, 4).swapaxes(-3, -2).reshape(*lead, 512)
    low = codes & 0x0F
    quads = low.reshape(*lead, 16, 2, 4, 4)  # (row, half, p, i)
    plane = (quads[..., 0, :, :] | (quads[..., 1, :, :] << 4)).swapaxes(-3, -2).reshape(*lead, 256)
    if bits == 4:
        return plane
    high = codes >> 4
    if bits == 5:  # byte 4r + i, bit j: element 4j + i
        bit = high.reshape(*lead, 16, 8, 4) << np.arange(8, dtype=np.uint8).reshape(8, 1)
        return np.concatenate([plane, np.bitwise_or.reduce(bit, axis=-2).reshape(*lead, 64)], axis=-1)
    # 6-bit: vector h, byte 4r + i, bits 2p, 2p + 1: element 16h + 4p + i
    pairs = high.reshape(*lead, 16, 2, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    planes = np.bitwise_or.reduce(pairs, axis=-2).swapaxes(-3, -2).reshape(*lead, 128)
    return np.concatenate([plane, planes], axis=-1)


def relaid_shape(qtype: str, out_features: int, in_features: int) -> tuple[int, int]:
    """(groups, bytes per group) of a relaid (out_features, in_features) weight."""
    tile = _HEADER[qtype] + SUPER_BLOCK[qtype] // 32 * _sub_bytes(qtype)
    return -(-out_features // ROWS), in_features // SUPER_BLOCK[qtype] * tile


def relayout(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """GGUF block rows (N, bytes per row) uint8 -> the kernel's tiles (groups, bytes per group)
    uint8: rows in groups of 16 (padded with zero rows), csrc/quant_format.h's layout."""
    rows, supers = blocks.shape[0], in_features // SUPER_BLOCK[qtype]
    per_super = _BLOCK_BYTES[qtype] * SUPER_BLOCK[qtype] // (256 if qtype in _K_QUANTS else 32)
    if tuple(blocks.shape) != (rows, supers * per_super) or blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype} blocks for {in_features} in_features: uint8 (rows, {supers * per_super}), "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    groups = -(-rows // ROWS)
    tile = _HEADER[qtype] + SUPER_BLOCK[qtype] // 32 * _sub_bytes(qtype)
    out = np.empty((groups, supers * tile), dtype=np.uint8)
    source = blocks.numpy()
    for first in range(0, groups * ROWS, _RELAYOUT_ROWS):  # a whole number of groups at a time
        raw = np.zeros((min(_RELAYOUT_ROWS, groups * ROWS - first), supers, per_super), dtype=np.uint8)
        part = source[first:first + _RELAYOUT_ROWS]
        raw[:len(part)] = part.reshape(len(part), supers, per_super)
        codes, header = _unpack(raw, qtype)
        g = len(raw) // ROWS
        # (g, 16, supers, bytes) -> (g, supers, bytes, 16): each header field is 16 rows' values side
        # by side (fp16 pairs stay together)
        fields = []
        for field in header:
            width = field.shape[-1]
            lanes = field.reshape(g, ROWS, supers, -1, 2 if width == 2 else 1)
            fields.append(lanes.transpose(0, 2, 3, 1, 4).reshape(g, supers, -1))
        subs = codes.reshape(g, ROWS, supers, -1, 32).transpose(0, 2, 3, 1, 4)  # (g, supers, subs, 16, 32)
        fields.append(_planes(subs, _BITS[qtype]).reshape(g, supers, -1))
        out[first // ROWS:first // ROWS + g] = np.concatenate(fields, axis=-1).reshape(g, -1)
    return torch.from_numpy(out)


def _ops(isa: str | None = None):
    return native.load("quant", isa)


def available(isa: str | None = None) -> bool:
    """The kernel built, with a vector path (AVX512 or AVX2): the scalar one is for tests."""
    ops = _ops(isa)
    return ops is not None and bool(ops.fast())


def supports(qtype: str, in_features: int) -> bool:
    return qtype in QTYPES and in_features % SUPER_BLOCK[qtype] == 0


def products_for(dtype: torch.dtype, activations: str = "dtype", isa: str | None = None) -> str:
    """The products a kernel computes: "int8" when asked and the build has a vector path, else the
    model dtype's (bfloat16 where the CPU has AVX512-BF16, else float32)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: must be one of {ACTIVATIONS}, got {activations!r}")
    ops = _ops(isa)
    if activations == "int8" and ops is not None and ops.has_products("int8"):
        return "int8"
    if dtype == torch.bfloat16 and ops is not None and ops.has_products("bfloat16"):
        return "bfloat16"
    return "float32"


class QuantKernel:
    """y = x @ weight.T (+ bias), float32 out, for x (T, in_features), on quantized blocks.
    The same call as models/linear.LinearKernel, which it replaces for a quantized weight.
    isa: run a build for another instruction set (native.ISA_FLAGS; tests and benchmarks)."""

    __slots__ = (
        "_ops",
        "bias",
        "gemm_dtype",
        "in_features",
        "out_features",
        "products",
        "qtype",
        "qtype_id",
        "weight",
    )

    ROWS = ROWS

    def __init__(self, blocks: torch.Tensor | None, qtype: str, in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, activations: str = "dtype", isa: str | None = None, *,
                 relaid: torch.Tensor | None = None, out_features: int | None = None) -> None:
        """blocks: GGUF rows (N, bytes per row) uint8; or None and `relaid`, the weight relaid
        already (an earlier start's, models/weights.KernelCache), with its out_features."""
        if not supports(qtype, in_features):
            raise ValueError(f"no quantized kernel for {qtype} with {in_features} input features")
        ops = _ops(isa)
        if ops is None:
            raise RuntimeError("the native quant kernel is not built on this machine")
        self.qtype = qtype
        self.qtype_id = GGML_TYPE_IDS[qtype]
        self.in_features = in_features
        if relaid is None:
            if blocks is None:
                raise ValueError("blocks: needed unless the weight comes relaid")
            self.out_features = blocks.shape[0]
            self.weight = relayout(blocks, qtype, in_features)  # uint8 (groups, bytes per group)
        else:
            if out_features is None:
                raise ValueError("out_features: needed with a relaid weight")
            self.out_features = out_features
            expected = relaid_shape(qtype, out_features, in_features)
            if relaid.dtype != torch.uint8 or tuple(relaid.shape) != expected:
                raise ValueError(f"relaid {qtype} weight for ({out_features}, {in_features}): expected uint8 "
                                 f"{expected}, got {relaid.dtype} {tuple(relaid.shape)}")
            self.weight = relaid
        self.bias = bias  # the module's Parameter: loading fills it after this kernel exists
        # A bfloat16 model's products in bfloat16 (twice the float32 rate where the CPU has
        # AVX512-BF16), int8 ones twice that again.
        self.products = products_for(dtype, activations, isa)
        # Long prompt chunks: torch's GEMM on the dequantized weight, in the model's dtype.
        self.gemm_dtype = torch.bfloat16 if products_for(dtype, "dtype", isa) == "bfloat16" else torch.float32
        self._ops = ops

    @staticmethod
    def relayout(tensor) -> torch.Tensor:
        """A models/weights.QuantizedTensor's blocks, relaid."""
        return relayout(tensor.blocks, tensor.qtype, tensor.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def bias_or_none(self) -> torch.Tensor | None:
        return self.bias if self.bias is not None and self.bias.numel() else None

    def reads_blocks(self, num_rows: int) -> bool:
        """True when num_rows tokens run on the blocks as they are (quant_linear), False when on
        torch's GEMM over the dequantized weight."""
        return num_rows <= GEMM_ROWS or self.products == "int8"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a float32 (T, out_features) view to write into (rows may be further apart: a column
        slice of a wider output), returned."""
        bias = self.bias_or_none
        num_rows = x.shape[0]
        if self.reads_blocks(num_rows):
            if out is None:
                return self._ops.quant_linear(x, self.weight, self.out_features, self.qtype_id, self.products, bias)
            self._ops.quant_linear_out(x, self.weight, self.out_features, self.qtype_id, self.products, bias, out)
            return out
        dtype = self.gemm_dtype
        weight = self._dequantize(dtype)
        # Token counts padded to a bucket: oneDNN keeps a primitive per shape (models/linear.py).
        y = F.linear(bucket_rows(x.to(dtype)), weight, None if bias is None else bias.to(dtype))[:num_rows]
        if out is None:
            return y.float()
        out.copy_(y)
        return out

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._ops.dequantize(self.weight, self.out_features, self.in_features, self.qtype_id, dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (out_features, in_features) these blocks stand for."""
        return self._dequantize(torch.float32)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (1-D integers) of the weight as float32 (len(ids), in_features), decoded from
        their blocks alone: a token embedding looked up without a float copy of the table."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"ids: a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.out_features):
            raise ValueError(f"ids: out of range for {self.out_features} rows")
        return self._ops.embedding(self.weight, self.out_features, self.in_features, self.qtype_id, ids)

