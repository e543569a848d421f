"""The native expert kernel and the raw-block matmul (csrc/experts.cpp, models/expert_kernels.py,
models/quant_raw.py): the blocks as gguf-py dequantizes them, the products with them as the
activations' int8 rounding leaves them, on every build this CPU runs; and the experts as the
torch reference computes them."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from tokenway import native
from tokenway.models import dequant, quant_raw
from tokenway.models.expert_kernels import (
    ExpertSpec,
    ExpertWeights,
    NativeExpertKernel,
    TorchExpertKernel,
    build,
    supports,
)

# This CPU's build (None: AVX512 with VNNI here), AVX2 without AVX512 (and without VNNI: the
# signed-code path), and the plain C++ one; each loads beside the others (native.load).
ISAS = [None, "avx2", "scalar"]
QTYPES = list(quant_raw.QTYPES)  # a GGUF's types; MXFP4_HF (scales apart) has tests of its own below
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Byte offsets of each type's float16 fields (scales, mins): valid small float16s there, as a
# real file has, random bytes (every code and packed-scale pattern) elsewhere.
F16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def ops_or_skip(isa):
    if native.load("experts", isa) is None:
        pytest.skip(f"no {isa or 'native'} build of the experts kernel on this machine")


def valid_blocks(qtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """uint8 (*shape[:-1], bytes a row) of `qtype` rows of shape[-1] weights: floats as stored,
    gguf-py's MXFP4 quantization of normal floats, random bytes with float16 scales in [1e-3, 1e-2]
    for the others. The first block is all zeros."""
    rng = np.random.default_rng(seed)
    *lead, cols = shape
    if qtype in FLOATS:
        weight = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.05).to(FLOATS[qtype])
        return weight.contiguous().view(torch.uint8).reshape(*lead, -1)
    if qtype == "MXFP4":
        weight = rng.standard_normal(shape).astype(np.float32) * 0.05
        return torch.from_numpy(gguf.quants.quantize(weight, gguf.GGMLQuantizationType.MXFP4).copy())
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (*lead, cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(1e-3, 1e-2, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:-1], 2)
    blocks.reshape(-1, type_size)[0] = 0
    return torch.from_numpy(blocks.reshape(*lead, -1))


def hf_mxfp4(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's safetensors layout of gguf-py's MXFP4 quantization of normal floats (*lead, cols):
    blocks uint8 (*lead, cols / 32, 16), byte j of a block elements 2j (low nibble) and 2j + 1
    (high), and scales uint8 (*lead, cols / 32)."""
    ggml = valid_blocks("MXFP4", shape, seed).numpy().reshape(*shape[:-1], shape[-1] // 32, 17)
    scales = ggml[..., 0].copy()
    codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-1)  # elements 0..31 in order
    pairs = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(pairs), torch.from_numpy(scales)


def gguf_weight(blocks: torch.Tensor, qtype: str, rows: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, cols))


def int8_block(qtype: str) -> int:
    return 256 if qtype in dequant.QTYPES and dequant.block_size(qtype) == 256 else 32


def as_products_see(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """x (float64) as the kernel meets it: float weights x itself; quantized ones x per block
    (32, or a 256 super-block) as dx q, dx = max|x| / 127, q = round(x * (127 / max|x|)) in float32."""
    if qtype in FLOATS:
        return x.double()
    blocks = x.float().reshape(x.shape[0], -1, int8_block(qtype))
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, 0.0)
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / 127).double()).reshape(x.shape)


def test_supports_names_the_types_read():
    for qtype in ("MXFP4", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q4_K", "Q6_K", "BF16"):
        assert supports(qtype) and quant_raw.supports(qtype, 512)
    assert not supports("Q4_1") and not supports("IQ2_XS")
    assert not quant_raw.supports("Q4_K", 128) and quant_raw.supports("MXFP4", 2880)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_block_matmul_is_the_product_with_gguf_weights(qtype, isa):
    """At 1, 3, 9 and 17 tokens (every token tile and its remainders), 37 rows (row tiles of 4
    and 2, and a remainder): the float64 product of gguf-py's weights and the activations as the
    kernel rounds them, up to float32 summation: 1e-5 of the largest output. 480 input features
    for the 32-weight types: an odd count of blocks (AVX512 takes two at a time)."""
    ops_or_skip(isa)
    cols = 512 if dequant.block_size(qtype) in (1, 256) else 480
    blocks = valid_blocks(qtype, (37, cols), seed=len(qtype))
    weight = gguf_weight(blocks, qtype, 37, cols).double()
    kernel = quant_raw.RawQuantKernel(blocks, qtype, cols, isa=isa)
    for tokens in (1, 3, 9, 17):
        torch.manual_seed(tokens)
        x = torch.randn(tokens, cols)
        x[0, :4] = torch.tensor([0.0, -0.0, 3e3, -2.5])
        x[-1, 32:64] = 0.0  # a block of zeros: scale 0
        expected = as_products_see(x, qtype) @ weight.T
        got = kernel(x)
        assert got.dtype == torch.float32 and got.shape == (tokens, 37)
        error = (got.double() - expected).abs().max() / expected.abs().max()
        assert error < 1e-5, f"{qtype} at {tokens} tokens: {error:.2e} of the largest output"


def test_hf_mxfp4_dequantizes_as_transformers_does():
    """gpt-oss's safetensors MXFP4 (blocks of nibble pairs, scales apart): dequant.mxfp4_pairs and
    ExpertWeights.dequantize are transformers' own convert_moe_packed_tensors exactly, and the
    same weights gguf-py reads from llama.cpp's layout of them."""
    integration = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = hf_mxfp4((3, 10, 96), seed=1)
    expected = integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, cols, rows)
    weights = ExpertWeights("MXFP4_HF", blocks.reshape(3, 10, 48), (3, 10, 96), scales)
    for e in range(3):
        assert torch.equal(weights.dequantize(e), expected[e].T.float())
        ggml = valid_blocks("MXFP4", (3, 10, 96), seed=1)[e]
        assert torch.equal(weights.dequantize(e), gguf_weight(ggml, "MXFP4", 10, 96))
    with pytest.raises(ValueError, match="scales are required"):
        ExpertWeights("MXFP4_HF", blocks.reshape(3, 10, 48), (3, 10, 96))
    with pytest.raises(ValueError, match="expected uint8 scales"):
        ExpertWeights("MXFP4_HF", blocks.reshape(3, 10, 48), (3, 10, 96), scales[:, :, :2])


def hf_experts(num_experts: int, hidden: int, inter: int, seed: int) -> list[ExpertWeights]:
    """gpt-oss's safetensors experts as weights.expert_weights maps them: gate and up every other
    row of one (E, 2 x inter, hidden) tensor (views: their rows two apart), down (E, hidden, inter)."""
    blocks, scales = hf_mxfp4((num_experts, 2 * inter, hidden), seed)
    fused = ExpertWeights("MXFP4_HF", blocks.reshape(num_experts, 2 * inter, -1), (num_experts, 2 * inter, hidden),
                          scales)
    blocks, scales = hf_mxfp4((num_experts, hidden, inter), seed + 1)
    down = ExpertWeights("MXFP4_HF", blocks.reshape(num_experts, hidden, -1), (num_experts, hidden, inter), scales)
    return [fused.every_other_row(0), fused.every_other_row(1), down]


@pytest.mark.parametrize("qtype", ["BF16", "F16", "F32"])
def test_float_weights_meet_a_prompt_chunk_through_torch_matmul(qtype):
    """From quant_raw.FLOAT_MATMUL_TOKENS tokens a float weight's rows are converted a slice at a
    time and meet x through torch's matmul: the same product as below it, written into out=."""
    ops_or_skip(None)
    rows, cols = 70, 96
    blocks = valid_blocks(qtype, (rows, cols), seed=4)
    bias = torch.randn(rows)
    kernel = quant_raw.RawQuantKernel(blocks, qtype, cols, bias=bias)
    weight = blocks.view(FLOATS[qtype]).float()
    x = torch.randn(quant_raw.FLOAT_MATMUL_TOKENS + 3, cols)
    expected = x.double() @ weight.double().T + bias.double()
    wide = torch.zeros(x.shape[0], rows + 5)
    got = kernel(x, out=wide[:, 5:])
    assert got.data_ptr() == wide[:, 5:].data_ptr() and (wide[:, :5] == 0).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(kernel(x[:9]), got[:9], rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "MXFP4", "Q4_0"])
def test_many_tokens_meet_a_row_in_groups(qtype, isa):
    """The AVX2 builds meet 8 (blocks of 32) or 16 (super-blocks) or more tokens a matrix in
    groups of 8 (csrc/expert_groups.h), passes of up to 6 groups: one group, one padded, three
    with the last padded, 5 in one pass, 6, 7 in two (4 + 3), 13 in three; the same product to
    the same tolerance as the token tiles."""
    ops_or_skip(isa)
    blocks = valid_blocks(qtype, (37, 768), seed=3)
    weight = gguf_weight(blocks, qtype, 37, 768).double()
    kernel = quant_raw.RawQuantKernel(blocks, qtype, 768, isa=isa)
    for tokens in (8, 15, 17, 33, 48, 49, 100):
        torch.manual_seed(tokens)
        x = torch.randn(tokens, 768)
        x[-1, 256:512] = 0.0  # a super-block of zeros: scale 0
        expected = as_products_see(x, qtype) @ weight.T
        error = (kernel(x).double() - expected).abs().max() / expected.abs().max()
        assert error < 1e-5, f"{qtype} at {tokens} tokens: {error:.2e} of the largest output"


def test_raw_kernel_is_the_quant_kernel_call():
    """out= a column slice of a wider output, the bias read at call time, embedding rows exact."""
    ops_or_skip(None)
    blocks = valid_blocks("Q3_K", (20, 256), seed=2)
    bias = torch.zeros(20)
    kernel = quant_raw.RawQuantKernel(blocks, "Q3_K", 256, bias=bias)
    assert (kernel.in_features, kernel.out_features, kernel.qtype, kernel.products) == (256, 20, "Q3_K", "int8")
    assert kernel.nbytes == blocks.numel() and kernel.weight.data_ptr() == blocks.data_ptr()  # in place
    x = torch.randn(5, 256)
    plain = kernel(x)
    bias.copy_(torch.arange(20.0))
    wide = torch.full((5, 30), -1.0)
    assert kernel(x, out=wide[:, 4:24]).data_ptr() == wide[:, 4:24].data_ptr()
    torch.testing.assert_close(wide[:, 4:24], plain + torch.arange(20.0), rtol=0, atol=1e-5)
    assert (wide[:, :4] == -1).all() and (wide[:, 24:] == -1).all()
    ids = torch.tensor([19, 0, 7, 7])
    assert torch.equal(kernel.embedding(ids), gguf_weight(blocks, "Q3_K", 20, 256)[ids])
    with pytest.raises(ValueError, match="ids"):
        kernel.embedding(torch.tensor([20]))
    with pytest.raises(ValueError, match="no raw-block kernel"):
        quant_raw.RawQuantKernel(blocks, "Q3_K", 100)
    with pytest.raises(ValueError, match="expected uint8 blocks"):
        quant_raw.RawQuantKernel(blocks[:, :100], "Q3_K", 256)


def experts_of(qtypes: tuple[str, str, str], num_experts: int, hidden: int, inter: int, seed: int):
    shapes = [(num_experts, inter, hidden), (num_experts, inter, hidden), (num_experts, hidden, inter)]
    return [ExpertWeights(qtype, valid_blocks(qtype, shape, seed + i), shape)
            for i, (qtype, shape) in enumerate(zip(qtypes, shapes, strict=True))]


def routing(tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 1 chosen by every token, some experts by none (only the first half is drawn from)."""
    gen = torch.Generator().manual_seed(seed)
    others = [2 + torch.randperm(num_experts // 2 - 2, generator=gen)[:top_k - 1] for _ in range(tokens)]
    ids = torch.stack([torch.cat([torch.tensor([1]), chosen]) for chosen in others])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    return ids, weights


CASES = {  # (gate, up, down), activation, biased; hidden 512, intermediate 256 (or 2 x 96 for 32-blocks)
    "qwen3-q4k-q6k": (("Q4_K", "Q4_K", "Q6_K"), "silu", False),
    "gptoss-mxfp4": (("MXFP4", "MXFP4", "MXFP4"), "swiglu_oai", True),
    "q2k-q3k-mix": (("Q2_K", "Q3_K", "Q5_K"), "silu", False),
    "iq4": (("IQ4_XS", "IQ4_XS", "IQ4_NL"), "silu", False),
    "q8-q4": (("Q8_0", "Q4_0", "Q8_0"), "swiglu_oai", True),
    "gptoss-safetensors": (("MXFP4_HF", "MXFP4_HF", "MXFP4_HF"), "swiglu_oai", True),  # hf_experts
}


def int8_reference(kernel: TorchExpertKernel, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """The experts in float64, pair by pair, with x and the activation before down rounded to
    int8 as the native kernel rounds them (as_products_see): its answer up to float32 sums."""
    dequantized: dict[tuple[int, int], torch.Tensor] = {}

    def linear(rows, w: ExpertWeights, bias, expert):
        if (id(w), expert) not in dequantized:
            dequantized[id(w), expert] = w.dequantize(expert).double().T
        product = as_products_see(rows, w.qtype) @ dequantized[id(w), expert]
        return product if bias is None else product + bias[expert].double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j in np.ndindex(*ids.shape):
        e = int(ids[t, j])
        gate = linear(x[t:t + 1], kernel.gate, kernel.gate_bias, e)
        up = linear(x[t:t + 1], kernel.up, kernel.up_bias, e)
        h = kernel.spec.apply(gate, up).float()
        out[t] += float(weights[t, j]) * linear(h, kernel.down, kernel.down_bias, e)[0]
    return out


@functools.cache
def case_of(case: str, tokens: int):
    """(the torch kernel, x, ids, weights, the int8-rounded float64 answer, torch's answer): once
    for every build tested."""
    qtypes, activation, biased = CASES[case]
    num_experts, top_k, hidden = 12, 4, 512
    inter = 256 if all(q in dequant.QTYPES and dequant.block_size(q) == 256 for q in qtypes) else 192
    if qtypes[0] == "MXFP4_HF":
        gate, up, down = hf_experts(num_experts, hidden, inter, seed=tokens)
    else:
        gate, up, down = experts_of(qtypes, num_experts, hidden, inter, seed=tokens)
    gen = torch.Generator().manual_seed(7)
    biases = ([torch.randn(num_experts, n, generator=gen) * 0.05 for n in (inter, inter, hidden)]
              if biased else [None, None, None])
    spec = ExpertSpec(activation, limit=0.5 if activation == "swiglu_oai" else 7.0)  # the clamp in play
    reference = TorchExpertKernel(gate, up, down, spec, *biases)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    ids, weights = routing(tokens, num_experts, top_k, seed=tokens)
    return reference, x, ids, weights, int8_reference(reference, x, ids, weights), reference(x, ids, weights)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_experts_are_what_the_torch_kernel_computes(case, tokens, isa):
    """Against the float64 experts on int8-rounded activations (x, and the activation before
    down) to 1e-3 of the largest output (the activation rounded from float32 sums rather than
    float64 ones may move a code at a tie); against torch's float32 kernel to 15% (int8's
    rounding of both activations through random weights and swiglu_oai's clamp: up to 9% seen),
    where a wrong expert, weight or bias is off by the output's own size."""
    ops_or_skip(isa)
    reference, x, ids, weights, exact, expected = case_of(case, tokens)
    native_kernel = NativeExpertKernel(reference.gate, reference.up, reference.down, reference.spec,
                                       reference.gate_bias, reference.up_bias, reference.down_bias, isa=isa)
    got = native_kernel(x, ids, weights)
    assert got.shape == (tokens, x.shape[1]) and got.dtype == torch.float32
    error = (got.double() - exact).abs().max() / exact.abs().max()
    assert error < 1e-3, f"{case}: {error:.2e} of the largest output"
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 0.15, f"{case}: {error:.2e} of the largest output from torch's"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ["gptoss-mxfp4", "gptoss-safetensors", "q8-q4", "iq4"])
def test_many_tokens_meet_decoded_rows(case, isa):
    """200 tokens: every expert chosen has >= 64 (expert 1 all 200), so the 32-weight types' rows
    are decoded to float32 (csrc/experts.cpp decoded_rows_times_tokens) rather than met as int8
    tiles, or on AVX2 MXFP4's and Q4_0's met in token groups (expert_groups.h): the same answers,
    to the same tolerances."""
    test_experts_are_what_the_torch_kernel_computes(case, 200, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ["qwen3-q4k-q6k", "q2k-q3k-mix"])
def test_many_tokens_meet_the_experts_rows_in_groups(case, isa):
    """200 tokens: expert 1's 200 and the others' ~150 meet Q4_K's (gate, up) and Q5_K's (down)
    rows in passes of token groups on the AVX2 builds: the same answers, to the same tolerances."""
    test_experts_are_what_the_torch_kernel_computes(case, 200, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["F32", "BF16", "F16"])
def test_float_experts_are_the_torch_kernels_exactly(qtype, isa):
    """Float experts meet float32 activations: the same sums as torch's up to float32 rounding,
    so routing, grouping, biases and the weighted sum show to 1e-5."""
    ops_or_skip(isa)
    num_experts, hidden, inter = 6, 64, 48
    gate, up, down = experts_of((qtype, qtype, qtype), num_experts, hidden, inter, seed=3)
    biases = [torch.randn(num_experts, n) for n in (inter, inter, hidden)]
    spec = ExpertSpec("swiglu_oai")
    x = torch.randn(37, hidden) * 10
    ids, weights = routing(37, num_experts, 2, seed=5)
    got = NativeExpertKernel(gate, up, down, spec, *biases, isa=isa)(x, ids, weights)
    expected = TorchExpertKernel(gate, up, down, spec, *biases)(x, ids, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_hf_experts_are_read_in_place_at_their_strides():
    """gpt-oss's gate and up (every other row of one tensor) and their scales stay views of the
    mapped file: the kernel reads them where they lie; its decode stack tensors are those."""
    ops_or_skip(None)
    gate, up, down = hf_experts(8, 64, 32, seed=2)
    kernel = NativeExpertKernel(gate, up, down, ExpertSpec("swiglu_oai"))
    assert kernel.gate.blocks.data_ptr() == gate.blocks.data_ptr() and kernel.gate.blocks.stride(1) == 2 * 32
    assert kernel.up.scales.data_ptr() == up.scales.data_ptr()
    x = torch.randn(3, 64)
    ids, weights = routing(3, 8, 2, seed=1)
    got, expected = kernel(x, ids, weights), TorchExpertKernel(gate, up, down, kernel.spec)(x, ids, weights)
    assert (got - expected).abs().max() < 0.15 * expected.abs().max()
    blocks_only = ExpertWeights("MXFP4", valid_blocks("MXFP4", (8, 32, 64)), (8, 32, 64))
    with pytest.raises(RuntimeError, match="scales are a tensor of their own"):
        kernel.ops.experts_forward(x, ids, weights, gate.blocks, 1039, up.blocks, 1039, down.blocks, 1039, 8, 32,
                                   None, None, None, 1, 1.702, 7.0, None, up.scales, down.scales)
    with pytest.raises(RuntimeError, match="scales are in its blocks"):
        kernel.ops.experts_forward(x, ids, weights, blocks_only.blocks, 39, up.blocks, 1039, down.blocks, 1039, 8, 32,
                                   None, None, None, 1, 1.702, 7.0, gate.scales, up.scales, down.scales)


def test_no_tokens_and_bad_routing():
    ops_or_skip(None)
    gate, up, down = experts_of(("Q4_K", "Q4_K", "Q6_K"), 4, 256, 256, seed=0)
    kernel = NativeExpertKernel(gate, up, down, ExpertSpec())
    empty = kernel(torch.zeros(0, 256), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 256)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(torch.zeros(1, 256), torch.tensor([[0, 4]]), torch.ones(1, 2))


def test_build_picks_native_where_it_reads_every_type():
    ops_or_skip(None)
    gate, up, down = experts_of(("Q4_K", "Q4_K", "Q6_K"), 4, 256, 256, seed=0)
    assert isinstance(build(gate, up, down, ExpertSpec()), NativeExpertKernel)
    assert isinstance(build(gate, up, down, ExpertSpec(), torch_device=torch.device("meta")), TorchExpertKernel)
    q4_1 = ExpertWeights("Q4_1", torch.zeros(4, 256, 256 // 32 * 20, dtype=torch.uint8), (4, 256, 256))
    assert isinstance(build(q4_1, q4_1, q4_1, ExpertSpec()), TorchExpertKernel)
    with pytest.raises(ValueError, match="no native expert kernel for Q4_1"):
        NativeExpertKernel(q4_1, q4_1, q4_1, ExpertSpec())
