"""GGUF blocks -> float32, in torch ops only, on whatever device the blocks are on.

The engine computes on GGUF blocks with native CPU kernels (quant.py). Where there are none (a
CUDA device, a CPU whose native build failed) the same blocks still run through this: whole
weights at load, or the rows an embedding lookup names. Bit ops, views and reshapes over all
blocks at once; no numpy, no Python loop over blocks.

Each type reproduces gguf-py's gguf.quants.dequantize (llama.cpp's dequantize_row_*) bit for bit:
the same float32 products and sums, in the same order, never fused into one rounding. Blocks are
read as little-endian (GGUF's byte order, and every device torch runs on).

    blocks  uint8 (rows, cols // block_size * type_size)   as GGUF stores a 2-D weight
    result  float32 (rows, cols)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # the values in one K-quant super-block


def dequantize(blocks: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """float32 (rows, cols) on blocks' device, from the GGUF blocks of a `qtype` weight."""
    rows, cols = shape
    block_size, type_size = _sizes(qtype)
    if cols % block_size:
        raise ValueError(f"{qtype}: {cols} columns is not a multiple of the block size {block_size}")
    expected = (rows, cols // block_size * type_size)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
        raise ValueError(f"{qtype} {shape}: expected uint8 blocks of shape {expected}, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    values = _DEQUANTIZE[qtype](blocks.contiguous().view(-1, type_size))  # (num_blocks, block_size)
    return values.view(rows, cols)


def dequantize_rows(blocks: torch.Tensor, qtype: str, shape: tuple[int, int], ids: torch.Tensor) -> torch.Tensor:
    """float32 (*ids.shape, cols): only the rows `ids` names (an embedding lookup), dequantized."""
    rows, cols = shape
    if blocks.dim() != 2 or blocks.shape[0] != rows:
        raise ValueError(f"{qtype} {shape}: expected {rows} rows of blocks, got shape {tuple(blocks.shape)}")
    picked = blocks.index_select(0, ids.reshape(-1).to(device=blocks.device, dtype=torch.long))
    return dequantize(picked, qtype, (picked.shape[0], cols)).view(*ids.shape, cols)


def block_size(qtype: str) -> int:
    """The weights one block of `qtype` holds (1 for the float types)."""
    return _sizes(qtype)[0]


def block_sizes(qtype: str) -> tuple[int, int]:
    """(weights a block, bytes a block) of `qtype`."""
    return _sizes(qtype)


def _sizes(qtype: str) -> tuple[int, int]:
    if qtype not in _DEQUANTIZE:
        raise ValueError(f"unsupported GGUF type {qtype!r}; expected one of {', '.join(_DEQUANTIZE)}")
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def _f16(b: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """float32 (n, 1): the little-endian float16 at byte `offset` of each block. Every type's
    blocks have an even size and their float16s even offsets, so the blocks are viewed whole:
    copying a 2-byte column out first costs more than the rest of a dequantization."""
    i = offset // 2
    return b.view(torch.float16)[:, i:i + 1].float()


def _unpack(b: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """(n, num_bytes) uint8 -> (n, num_bytes // group * 8 // bits, group) uint8: every `group`
    bytes hold 8 // bits runs of `group` values, the lowest bits' run first (ggml's layout)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device).view(1, 1, -1, 1)
    values = (b.reshape(b.shape[0], -1, 1, group) >> shifts) & ((1 << bits) - 1)
    return values.reshape(b.shape[0], -1, group)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32).clone()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # The 16 bits become a float32's top half: exact, NaN payloads included.
    return (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: 16 bytes of 4-bit q; x = d * (q - 8)
    q = _unpack(b[:, 2:], 16, 4).reshape(b.shape[0], 32)
    return _f16(b) * (q.to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m: f16, qs: 16 bytes; x = d * q + m
    q = _unpack(b[:, 4:], 16, 4).reshape(b.shape[0], 32)
    return _f16(b) * q.float() + _f16(b, 2)


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit q of Q5_0 / Q5_1: 4 low bits from 16 bytes of nibbles, the 5th from a uint32."""
    high = _unpack(b[:, qh_at:qh_at + 4], 1, 1).reshape(b.shape[0], 32)
    low = _unpack(b[:, qh_at + 4:], 16, 4).reshape(b.shape[0], 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qh: u32, qs: 16 bytes; x = d * (q - 16)
    return _f16(b) * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m: f16, qh: u32, qs: 16 bytes; x = d * q + m
    return _f16(b) * _q5(b, 4).float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: 32 int8; x = q * d
    return b[:, 2:].view(torch.int8).float() * _f16(b)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales: 16 bytes (4-bit scale | 4-bit min per 16 values), qs: 64 bytes of 2-bit q, d, dmin: f16
    n = b.shape[0]
    scales, d, dmin = b[:, :16], _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0xF).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _unpack(b[:, 16:80], 32, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask: 32 bytes (the 3rd bit, set meaning no -4), qs: 64 bytes of 2-bit q, scales: 12 bytes of
    # 16 6-bit scales (low 4 bits in 8 bytes, high 2 bits in 4), d: f16
    n = b.shape[0]
    low = _unpack(b[:, 96:104], 8, 4).reshape(n, 16)
    high = _unpack(b[:, 104:108], 4, 2).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(b, 108) * scales).view(n, 16, 1)
    ql = _unpack(b[:, 32:96], 32, 2).reshape(n, 16, 16)
    qh = _unpack(b[:, :32], 32, 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).view(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 6-bit scales and 8 6-bit mins, float32 (n, 8) each."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mins.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin: f16, scales: 12 bytes, qs: 128 bytes of 4-bit q
    n = b.shape[0]
    sc, mins = _k_scale_min(b[:, 4:16])
    d = (_f16(b) * sc).view(n, 8, 1)
    dm = (_f16(b, 2) * mins).view(n, 8, 1)
    q = _unpack(b[:, 16:], 32, 4).float()
    return (d * q - dm).view(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # as Q4_K, with qh: 32 bytes of each value's 5th bit
    n = b.shape[0]
    sc, mins = _k_scale_min(b[:, 4:16])
    d = (_f16(b) * sc).view(n, 8, 1)
    dm = (_f16(b, 2) * mins).view(n, 8, 1)
    q = (_unpack(b[:, 48:], 32, 4) | (_unpack(b[:, 16:48], 32, 1) << 4)).float()
    return (d * q - dm).view(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql: 128 bytes of low 4 bits, qh: 64 bytes of high 2 bits, scales: 16 int8, d: f16; x = d * s * (q - 32)
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    ql = _unpack(b[:, :128], 64, 4).reshape(n, 8, 32)
    qh = _unpack(b[:, 128:192], 32, 2)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    return (d * q).view(n, QK_K)


# IQ4_NL's and IQ4_XS's 16 non-linear levels; MXFP4's e2m1 values, doubled (its scale is halved).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _lookup(codes: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    table = torch.tensor(values, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """float32 of MXFP4's E8M0 scale byte, halved (ggml_e8m0_to_fp32_half): exact powers of two."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # e: E8M0 scale byte, qs: 16 bytes of e2m1 codes; x = d/2 * 2v
    q = _unpack(b[:, 1:], 16, 4).reshape(b.shape[0], 32)
    return _e8m0_half(b[:, :1]) * _lookup(q, MXFP4_VALUES)


def mxfp4_pairs(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 (rows, 32 x blocks) of MXFP4 as gpt-oss's safetensors store it (transformers'
    convert_moe_packed_tensors): blocks (rows, 16 x blocks) of nibble pairs (byte j holds elements
    2j low, 2j + 1 high), scales (rows, blocks) E8M0 bytes, each its block's 2^(e - 127)."""
    rows = blocks.shape[0]
    pairs = blocks.reshape(rows, -1, 16)
    codes = torch.stack((pairs & 0x0F, pairs >> 4), dim=-1).reshape(rows, -1, 32)
    return (_e8m0_half(scales.reshape(rows, -1, 1)) * _lookup(codes, MXFP4_VALUES)).reshape(rows, -1)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: 16 bytes of indices into IQ4_VALUES
    q = _unpack(b[:, 2:], 16, 4).reshape(b.shape[0], 32)
    return _f16(b) * _lookup(q, IQ4_VALUES)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # d: f16, scales_h: u16 (2 high bits a sub-block), scales_l: 4 bytes (4 low bits a sub-block),
    # qs: 128 bytes, 8 sub-blocks of 32 (16 bytes each: low nibbles, then high)
    n = b.shape[0]
    low = _unpack(b[:, 4:8], 4, 4).transpose(1, 2).reshape(n, 8)  # byte i: sub-blocks 2i (low), 2i + 1
    high = _unpack(b[:, 2:4], 2, 2).transpose(1, 2).reshape(n, 8)  # 2 bits a sub-block, little-endian
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(b) * scales).view(n, 8, 1)
    q = _unpack(b[:, 8:], 16, 4).reshape(n, 8, 32)
    return (dl * _lookup(q, IQ4_VALUES)).view(n, QK_K)


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32, "F16": _f16, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "MXFP4": _mxfp4, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}

# The types dequantize reads (GGUF type names).
QTYPES = tuple(_DEQUANTIZE)
