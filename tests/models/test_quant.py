"""Matmuls on GGUF blocks (models/quant.py, csrc/quant.cpp): the blocks are the weights gguf-py
dequantizes, the kernel's products are the float product with those weights, and the engine
serving the default GGUF on them answers as the float model does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tokenway.models import quant  # noqa: E402

needs_kernel = pytest.mark.skipif(not quant.available(), reason="the quant kernel has no vector path on this CPU")


def quantized(rows: int, cols: int, qtype: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF block rows, the float weight they dequantize to)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero block
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(weight, kind)
    return torch.from_numpy(blocks), torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(rows, cols))


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_relaid_blocks_dequantize_to_what_gguf_reads(qtype):
    blocks, weight = quantized(24, 192, qtype)
    kernel = quant.QuantKernel(blocks, qtype, 192) if quant._ops() is not None else None
    if kernel is None:
        pytest.skip("the native quant kernel does not build here")
    torch.testing.assert_close(kernel.dequantize(), weight, atol=1e-6, rtol=1e-6)
    assert kernel.out_features == 24
    assert kernel.nbytes < weight.numel() * 2  # less than bfloat16


@needs_kernel
@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 17, quant.GEMM_ROWS + 3])
@pytest.mark.parametrize("in_features", [32, 96, 576, 1536])
def test_kernel_is_the_float_product_with_the_dequantized_weight(qtype, tokens, in_features):
    """Token counts around the 8-token register tile and past GEMM_ROWS (dequantized for the
    call), one block, an odd number of blocks, rows in several chunks: float32 products up to
    summation order."""
    blocks, weight = quantized(200, in_features, qtype, seed=tokens)
    kernel = quant.QuantKernel(blocks, qtype, in_features)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, in_features)
    got = kernel(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, 200)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 11, quant.GEMM_ROWS + 20])
@pytest.mark.parametrize("in_features", [32, 96, 576])
def test_a_bfloat16_model_gets_bfloat16_activations_on_the_exact_weights(qtype, tokens, in_features):
    """With bfloat16 products (AVX512-BF16) the activations are rounded to bfloat16 as a bfloat16
    model's are, the weights are the exact d * q + m, and the sums are float32: so the result is
    the float64 product of those two up to float32 summation (of sums the kernel biases by 128 or
    2304 times the block's activation sum: 1e-4 of the largest output here, where rounding the
    weights to bfloat16 costs 1e-2). 37 rows: a partial group of 16."""
    blocks, weight = quantized(37, in_features, qtype, seed=tokens)
    kernel = quant.QuantKernel(blocks, qtype, in_features, dtype=torch.bfloat16)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, in_features)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-39, 3e4, -2.5])  # zeros, a subnormal, a large value
    got = kernel(x)
    if tokens > quant.GEMM_ROWS or kernel.products != "bfloat16":
        # oneDNN's GEMM on the bfloat16-rounded weight; without AVX512-BF16, float32 products.
        expected, tolerance = x.bfloat16().double() @ weight.bfloat16().double().T, 2e-2
    else:
        expected, tolerance = x.bfloat16().double() @ weight.double().T, 1e-4
    torch.testing.assert_close(got.double(), expected, atol=tolerance * expected.abs().max().item(), rtol=tolerance)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as int8 products see it: per block of 32, dx * round(x / dx), dx = max |x| / 127."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (rounded * scale).reshape(x.shape)


needs_int8 = pytest.mark.skipif(not quant.available() or quant.products_for(torch.float32, "int8") != "int8",
                                reason="no AVX512-VNNI")


@needs_int8
@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 11, quant.GEMM_ROWS + 20])
@pytest.mark.parametrize("in_features", [32, 96, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_products_are_exact_on_the_int8_rounded_activations(qtype, tokens, in_features, dtype):
    """int8 products (AVX512-VNNI): each block of 32 activations is rounded to int8 with one
    scale, and the result is the float64 product of those and the exact weights up to float32
    summation, offsets included (Q4_1's m and Q8_0's 128 meet the same rounded activations).
    Past GEMM_ROWS they stay on the blocks. Zero blocks, a large value, 37 rows (a partial group)."""
    blocks, weight = quantized(37, in_features, qtype, seed=tokens)
    kernel = quant.QuantKernel(blocks, qtype, in_features, dtype=torch.bfloat16, activations="int8")
    assert kernel.products == "int8"
    torch.manual_seed(tokens)
    x = torch.randn(tokens, in_features).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-39, 3e4, -2.5])
    if in_features >= 64:
        x[-1, 32:64] = 0.0  # a block of zeros: scale 0
    got = kernel(x)
    expected = int8_rounded(x.float()) @ weight.double().T
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-4)
    # and within int8's rounding of the float product: about 1/254 of each block's largest |x|
    exact = x.double() @ weight.double().T
    assert (got.double() - exact).norm() / exact.norm() < 0.02


def test_activation_choices():
    assert quant.products_for(torch.float32) == "float32"
    assert quant.products_for(torch.float32, "int8") in ("int8", "float32")
    assert quant.products_for(torch.bfloat16) in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="activations"):
        quant.products_for(torch.bfloat16, "int4")


@needs_kernel
def test_bias_bfloat16_input_and_strided_rows():
    blocks, weight = quantized(64, 128, "Q4_1")
    bias = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    kernel = quant.QuantKernel(blocks, "Q4_1", 128, bias=bias)
    x = torch.randn(5, 256)[:, ::2]  # not contiguous
    without = kernel(x)
    bias.data = torch.randn(64)  # loading fills the bias after the kernel is built
    torch.testing.assert_close(kernel(x), without + bias)
    torch.testing.assert_close(kernel(x.bfloat16()), kernel(x.bfloat16().float()))
    assert kernel(torch.zeros(0, 128)).shape == (0, 64)
    torch.testing.assert_close(kernel(torch.zeros(2, 128)), bias.data.expand(2, 64))


def test_unsupported_shapes_are_refused():
    assert not quant.supports("Q4_1", 48)  # not whole blocks
    assert not quant.supports("Q4_K", 256)
    if quant._ops() is None:
        pytest.skip("the native quant kernel does not build here")
    with pytest.raises(ValueError, match="Q4_K"):
        quant.QuantKernel(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 256)
    blocks, _ = quantized(8, 128, "Q8_0")
    kernel = quant.QuantKernel(blocks, "Q8_0", 128)
    with pytest.raises(RuntimeError, match="bytes expected for 8 rows of 64 in_features"):
        kernel(torch.randn(2, 64))


@pytest.fixture(scope="module")
def quantized_llm(default_model_dir):
    if not quant.available():
        pytest.skip("the quant kernel has no vector path on this CPU")
    from tokenway import LLM

    return LLM(str(default_model_dir), dtype="float32", quantization="auto", kv_cache_memory="512MiB",
               max_num_batched_tokens=256, show_progress=False)


def test_the_default_gguf_serves_on_its_blocks(quantized_llm, llm):
    """Every matmul (30 layers x qkv, o, gate_up, down, and the tied Q8_0 head) runs on GGUF
    blocks, and the answers are the float model's (the same dequantized weights): the same
    greedy text, the same next-token log-probabilities up to float32 summation order."""
    from tokenway import SamplingParams

    model = quantized_llm.engine.model
    assert model.num_quantized_matmuls == 30 * 4 + 1 and model.linear_kernels() == []
    assert all(p.numel() == 0 for name, p in model.named_parameters() if name.endswith(("_weight", "lm_head")))
    assert quantized_llm.engine.runner.native_layers == (quantized_llm.engine.runner.decode_kernel is not None)
    prompts = [{"prompt_token_ids": quantized_llm.tokenizer.encode(text)} for text in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot", "1, 2, 3, 4, 5,")]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    for q, f in zip(quantized_llm.generate(prompts, params), llm.generate(prompts, params)):
        assert q.outputs[0].token_ids == f.outputs[0].token_ids
        q_first, f_first = q.outputs[0].logprobs[0], f.outputs[0].logprobs[0]
        assert [t for t, _ in q_first.top] == [t for t, _ in f_first.top]
        np.testing.assert_allclose([lp for _, lp in q_first.top], [lp for _, lp in f_first.top], atol=1e-3)


@needs_int8
def test_a_bfloat16_engine_meets_its_blocks_in_int8_unless_told(default_model_dir, llm):
    """The default (`quant_activations="auto"`, a bfloat16 or auto dtype) runs every matmul on
    int8 products where the CPU has AVX512-VNNI; "dtype" keeps the model dtype's. Either
    answers as the float model does at the first token: the same pick and a log-probability
    within int8's rounding (bench/accuracy_bench.py measures the whole continuation)."""
    from tokenway import LLM, SamplingParams

    prompts = [{"prompt_token_ids": llm.tokenizer.encode(text)} for text in
               ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,")]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, ignore_eos=True)
    reference = llm.generate(prompts, params)
    for activations, products in (("auto", "int8"), ("dtype", "bfloat16" if quant.products_for(
            torch.bfloat16) == "bfloat16" else "float32")):
        engine = LLM(str(default_model_dir), dtype="bfloat16", quant_activations=activations,
                     kv_cache_memory="256MiB", show_progress=False)
        assert {kernel.products for kernel in engine.engine.model.quant_kernels()} == {products}
        for got, want in zip(engine.generate(prompts, params), reference):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert abs(got.outputs[0].logprobs[0].logprob - want.outputs[0].logprobs[0].logprob) < 0.1
        del engine


def test_quant_activations_is_checked():
    from tokenway.config import EngineConfig

    with pytest.raises(ValueError, match="quant_activations"):
        EngineConfig(quant_activations="int4")
