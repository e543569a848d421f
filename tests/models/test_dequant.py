"""models/dequant.py against gguf-py's gguf.quants.dequantize, bit for bit, on every device here."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenway.models.dequant import dequantize, dequantize_rows

# Types gguf-py can quantize: their blocks come from real floats.
QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
# Byte offsets of each block's float16 fields (scales, mins): random bytes elsewhere, valid
# float16s there, as a real file has.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


def quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    floats = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    blocks = gguf.quants.quantize(floats, gguf.GGMLQuantizationType[qtype])
    return np.ascontiguousarray(blocks).view(np.uint8).reshape(rows, -1)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, cols // block_size)) * 0.05).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    if qtype == "MXFP4":  # every E8M0 scale that keeps 12 x 2^(e - 128) finite: the subnormal ones too
        blocks[..., 0] = rng.integers(0, 250, (rows, cols // block_size), dtype=np.uint8)
        blocks[0, :2, 0] = (0, 1)
    return blocks.reshape(rows, -1)


def reference(blocks: np.ndarray, qtype: str, rows: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, cols))


def assert_bitwise_equal(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    mismatched = (ours.cpu().view(torch.int32) != expected.view(torch.int32)).nonzero()
    assert len(mismatched) == 0, f"{len(mismatched)} values differ, first at {mismatched[0].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QUANTIZABLE)
@pytest.mark.parametrize("rows", [1, 7])
def test_quantized_floats(qtype, rows, device):
    cols = 2 * 256  # two K-quant super-blocks, sixteen 32-blocks
    blocks = quantized(qtype, rows, cols)
    ours = dequantize(torch.from_numpy(blocks).to(device), qtype, (rows, cols))
    assert ours.device.type == device
    assert_bitwise_equal(ours, reference(blocks, qtype, rows, cols))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", list(F16_FIELDS))
@pytest.mark.parametrize("rows", [1, 5])
def test_random_blocks(qtype, rows, device):
    """Every bit pattern of the quants and packed scales, not only those a quantizer writes."""
    cols = 3 * 256
    blocks = random_blocks(qtype, rows, cols)
    ours = dequantize(torch.from_numpy(blocks).to(device), qtype, (rows, cols))
    assert ours.device.type == device
    assert_bitwise_equal(ours, reference(blocks, qtype, rows, cols))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_dequantize_rows_is_an_embedding_lookup(qtype, device):
    rows, cols = 11, 256
    blocks = random_blocks(qtype, rows, cols) if qtype in F16_FIELDS else quantized(qtype, rows, cols)
    ids = torch.tensor([[3, 0, 10], [3, 7, 7]])
    ours = dequantize_rows(torch.from_numpy(blocks).to(device), qtype, (rows, cols), ids.to(device))
    assert ours.shape == (2, 3, cols) and ours.device.type == device
    assert_bitwise_equal(ours, reference(blocks, qtype, rows, cols)[ids])


def test_result_does_not_alias_the_blocks():
    blocks = quantized("F32", 2, 32)
    tensor = torch.from_numpy(blocks.copy())
    ours = dequantize(tensor, "F32", (2, 32))
    ours.zero_()
    assert torch.equal(tensor, torch.from_numpy(blocks))


@pytest.mark.parametrize(("blocks", "qtype", "shape", "message"), [
    (torch.zeros(2, 34, dtype=torch.uint8), "IQ2_XS", (2, 32), r"unsupported GGUF type 'IQ2_XS'; expected one of F32"),
    (torch.zeros(2, 34, dtype=torch.uint8), "Q8_0", (2, 48), r"48 columns is not a multiple of the block size 32"),
    (torch.zeros(2, 36, dtype=torch.uint8), "Q8_0", (2, 32), (r"expected uint8 blocks of shape \(2, 34\), got "
                                                             r"torch.uint8 \(2, 36\)")),
    (torch.zeros(2, 34, dtype=torch.int8), "Q8_0", (2, 32), r"expected uint8 blocks"),
])
def test_bad_input_is_a_value_error(blocks, qtype, shape, message):
    with pytest.raises(ValueError, match=message):
        dequantize(blocks, qtype, shape)
