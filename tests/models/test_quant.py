"""Matmuls on GGUF blocks (models/quant.py, csrc/quant.cpp): the blocks are the weights gguf-py
dequantizes, the kernel's products are the float product with those weights, and the engine
serving the default GGUF on them answers as the float model does."""

from __future__ import annotations

import gguf  # a dependency of tokenway itself (models/quant.py imports it)
import numpy as np
import pytest
import torch

from tokenway.models import quant

needs_kernel = pytest.mark.skipif(not quant.available(), reason="the quant kernel has no vector path on this CPU")

# Every build this CPU runs: its own (None), AVX2 without AVX512 (as most of the fleet), and the
# scalar fallback; each loads beside the others under its own library name (native.load).
ISAS = [None, "avx2", "scalar"]
TOKENS = [1, 3, 8, 17, 64]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def ops_or_skip(isa):
    if quant._ops(isa) is None:
        pytest.skip(f"no {isa or 'native'} build of the quant kernel on this machine")


def valid_blocks(rows: int, cols: int, qtype: str, seed: int = 0) -> np.ndarray:
    """GGUF block rows: gguf-py's quantization of a random weight where it has one, else random
    bytes (every code, scale and high bit pattern) with fp16 scales d, dmin in [1e-3, 1e-2].
    Row 0 starts with an all-zero block."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in K_QUANTS:
        weight = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        weight[0, :32] = 0.0
        return gguf.quants.quantize(weight, kind)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, cols // block_size, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[..., 208:210] = scales[..., :2]
    else:
        blocks[..., 0:4] = scales
    blocks[0, 0] = 0
    return blocks.reshape(rows, -1)


def quantized(rows: int, cols: int, qtype: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF block rows, the float weight gguf-py dequantizes them to)."""
    blocks = valid_blocks(rows, cols, qtype, seed)
    weight = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).reshape(rows, cols)
    return torch.from_numpy(blocks), torch.from_numpy(weight)


def int8_rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as int8 products see it: per block of 32 (a K-quant's super-block of 256), dx * round(x / dx),
    dx = max |x| / 127."""
    blocks = x.double().reshape(x.shape[0], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (rounded * scale).reshape(x.shape)


PRODUCTS = {"float32": (torch.float32, "dtype"), "bfloat16": (torch.bfloat16, "dtype"),
            "int8": (torch.bfloat16, "int8")}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_relaid_blocks_dequantize_to_what_gguf_reads(qtype, isa):
    """Exactly: the relayout keeps every code and scale, and the decoder does gguf-py's float32
    operations. 37 rows: a partial group of 16."""
    ops_or_skip(isa)
    blocks, weight = quantized(37, 512, qtype)
    kernel = quant.QuantKernel(blocks, qtype, 512, isa=isa)
    assert torch.equal(kernel.dequantize(), weight)
    assert kernel.out_features == 37
    # the relaid bytes are the stored ones but for the K-quants' 6-bit scales kept as bytes
    stored = blocks.numel() / 37 / 512
    assert stored <= kernel.nbytes / (48 * 512) <= stored + 1 / 8


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_embedding_rows_are_gguf_rows(qtype):
    ops_or_skip(None)
    blocks, weight = quantized(37, 256, qtype, seed=3)
    kernel = quant.QuantKernel(blocks, qtype, 256)
    ids = torch.tensor([36, 0, 5, 5, 16, 17])
    assert torch.equal(kernel.embedding(ids), weight[ids])
    assert kernel.embedding(torch.zeros(0, dtype=torch.long)).shape == (0, 256)
    for bad in (torch.tensor([37]), torch.tensor([-1]), torch.tensor([[1]]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="ids"):
            kernel.embedding(bad)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_block_products_are_the_product_with_gguf_weights(qtype, products, isa):
    """At 1, 3, 8, 17 and 64 tokens (token tiles of 8 or 4 and their remainders), 37 rows (groups
    of 16 in a pair and alone), two K-quant super-blocks: the float64 product of the exact weights
    and the activations as the products see them (float32; bfloat16-rounded; int8 per block of
    32, or of 256 for the K-quants), up to float32 summation: 1e-5 of the largest output (the
    bfloat16 path's sums carry 128 x the block's activation sum, so 1e-4 there). Zeros, a
    subnormal, a large value, a block of zeros in the activations."""
    ops_or_skip(isa)
    dtype, activations = PRODUCTS[products]
    if quant.products_for(dtype, activations, isa) != products:
        pytest.skip(f"no {products} products in this build")
    blocks, weight = quantized(37, 512, qtype, seed=len(products))
    kernel = quant.QuantKernel(blocks, qtype, 512, dtype=dtype, activations=activations, isa=isa)
    assert kernel.products == products
    for tokens in TOKENS:
        torch.manual_seed(tokens)
        x = torch.randn(tokens, 512)
        x[0, :5] = torch.tensor([0.0, -0.0, 1e-39, 3e4, -2.5])
        x[-1, 64:96] = 0.0
        seen = {"float32": x.double(), "bfloat16": x.bfloat16().double(),
                "int8": int8_rounded(x, 256 if qtype in K_QUANTS else 32)}[products]
        expected = seen @ weight.double().T
        got = kernel._ops.quant_linear(x, kernel.weight, 37, kernel.qtype_id, products, None)  # on the blocks at any T
        tolerance = 1e-4 if products == "bfloat16" else 1e-5
        torch.testing.assert_close(got.double(), expected, atol=tolerance * expected.abs().max().item(), rtol=1e-4)
        if products == "int8":  # and within int8's rounding of the float product
            exact = x.double() @ weight.double().T
            assert (got.double() - exact).norm() / exact.norm() < 0.02


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_long_chunks_multiply_the_dequantized_weight(qtype):
    """Past GEMM_ROWS tokens float32 products run torch's GEMM on the dequantized weight."""
    blocks, weight = quantized(40, 256, qtype)
    kernel = quant.QuantKernel(blocks, qtype, 256)
    assert not kernel.reads_blocks(quant.GEMM_ROWS + 1)
    x = torch.randn(quant.GEMM_ROWS + 5, 256)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(kernel(x).double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-4)


def test_activation_choices():
    assert quant.products_for(torch.float32) == "float32"
    assert quant.products_for(torch.float32, "int8") in ("int8", "float32")
    assert quant.products_for(torch.bfloat16) in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="activations"):
        quant.products_for(torch.bfloat16, "int4")


def test_each_build_says_what_it_computes():
    """AVX2 builds have int8 and float32 products (no bfloat16 instruction), the scalar one
    float32 only and no vector path: the engine reads blocks where `available()`."""
    if quant._ops("avx2") is not None:
        assert quant.available("avx2") and quant._ops("avx2").isa() in ("avx2", "avx2-vnni")
        assert quant.products_for(torch.bfloat16, "int8", "avx2") == "int8"
        assert quant.products_for(torch.bfloat16, "dtype", "avx2") == "float32"
    if quant._ops("scalar") is not None:
        assert not quant.available("scalar") and quant._ops("scalar").isa() == "scalar"
        assert quant.products_for(torch.bfloat16, "int8", "scalar") == "float32"


@needs_kernel
@pytest.mark.parametrize("products", ["float32", "int8"])
def test_bias_bfloat16_input_strided_rows_and_an_output_slice(products):
    blocks, _ = quantized(64, 256, "Q4_K")
    bias = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    dtype, activations = PRODUCTS[products]
    kernel = quant.QuantKernel(blocks, "Q4_K", 256, bias=bias, dtype=dtype, activations=activations)
    x = torch.randn(5, 512)[:, ::2]  # not contiguous
    without = kernel(x)
    bias.data = torch.randn(64)  # loading fills the bias after the kernel is built
    torch.testing.assert_close(kernel(x), without + bias)
    torch.testing.assert_close(kernel(x.bfloat16()), kernel(x.bfloat16().float()))
    assert kernel(torch.zeros(0, 256)).shape == (0, 64)
    torch.testing.assert_close(kernel(torch.zeros(2, 256)), bias.data.expand(2, 64))
    # q/k/v of different types write into one (T, 3 x 64) output's column slices
    other = quant.QuantKernel(quantized(64, 256, "Q6_K")[0], "Q6_K", 256, dtype=dtype, activations=activations)
    fused = torch.full((5, 200), 7.0)
    assert kernel(x, out=fused[:, 10:74]).data_ptr() == fused[:, 10:74].data_ptr()
    other(x, out=fused[:, 74:138])
    torch.testing.assert_close(fused[:, 10:74], kernel(x))
    torch.testing.assert_close(fused[:, 74:138], other(x))
    assert (fused[:, :10] == 7).all() and (fused[:, 138:] == 7).all()


def test_unsupported_shapes_are_refused():
    assert not quant.supports("Q4_1", 48)  # not whole blocks
    assert not quant.supports("Q4_K", 128)  # not whole super-blocks
    assert not quant.supports("Q2_K", 256)
    assert quant.supports("Q6_K", 512)
    if quant._ops() is None:
        pytest.skip("the native quant kernel does not build here")
    with pytest.raises(ValueError, match="Q2_K"):
        quant.QuantKernel(torch.zeros(4, 84, dtype=torch.uint8), "Q2_K", 256)
    with pytest.raises(ValueError, match="Q4_K blocks"):
        quant.QuantKernel(torch.zeros(4, 100, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="^blocks: needed unless the weight comes relaid$"):
        quant.QuantKernel(None, "Q4_K", 256)
    with pytest.raises(ValueError, match="^out_features: needed with a relaid weight$"):
        quant.QuantKernel(None, "Q4_K", 256, relaid=torch.zeros(1, 1, dtype=torch.uint8))
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


needs_int8 = pytest.mark.skipif(not quant.available() or quant.products_for(torch.float32, "int8") != "int8",
                                reason="no int8 products")


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
