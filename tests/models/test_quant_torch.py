"""The block kernels' torch fallback (models/quant_torch.py), the path a GPU takes: blocks kept as
stored, dequantized per call. Run here on the CPU, where it must give what the native path and
gguf-py give."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenway.models.quant_torch import TorchQuantKernel


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_1"])
def test_matmul_equals_gguf_dequantize_then_matmul(qtype):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = torch.from_numpy(gguf.quants.quantize(weight, kind))
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind).reshape(40, 96))
    bias = torch.randn(40)
    kernel = TorchQuantKernel(blocks, qtype, 96, bias=bias)
    x = torch.randn(5, 96)
    torch.testing.assert_close(kernel(x), x @ reference.T + bias, atol=1e-5, rtol=1e-5)
    out = torch.zeros(5, 50)
    kernel(x, out=out[:, 3:43])
    torch.testing.assert_close(out[:, 3:43], x @ reference.T + bias, atol=1e-5, rtol=1e-5)
    assert torch.equal(kernel.embedding(torch.tensor([7, 0, 39])), reference[[7, 0, 39]])
    assert kernel.nbytes == blocks.nbytes  # the blocks, not floats


def test_engine_model_on_torch_kernels_generates_as_on_native_ones(default_model_dir):
    """The default GGUF's Q4_1/Q8_0 blocks through torch operators: the float32 model's greedy tokens."""
    from tokenway.engine.request import Request
    from tokenway.engine.runner import ModelRunner
    from tokenway.engine.scheduler import SchedulerOutput
    from tokenway.models.config import ModelConfig
    from tokenway.models.decoder import DecoderForCausalLM
    from tokenway.models.weights import iter_weights, quantized_weights
    from tokenway.protocol.sampling import SamplingParams

    config = ModelConfig.from_dir(default_model_dir)
    models = []
    for torch_device in (torch.device("cpu"), None):
        model = DecoderForCausalLM(config, torch.float32, max_positions=256)
        used = model.use_quantized(quantized_weights(default_model_dir), torch_device=torch_device) \
            if torch_device is not None else set()
        model.load_weights(iter_weights(default_model_dir, skip=used))
        models.append(model.eval())
    torch_model = models[0]
    assert torch_model.num_quantized_matmuls == 30 * 4 + 1 and torch_model.embedding is not None
    tokens = [1, 504, 3458, 282, 4649, 314, 253]
    logits = []
    for model in models:
        runner = ModelRunner(model, num_blocks=8, block_size=16, device=torch.device("cpu"), native_attention=False)
        request = Request("r", tokens, SamplingParams(temperature=0))
        logits.append(runner.execute(SchedulerOutput([request], [len(tokens)], [[0]]))[0])
    torch.testing.assert_close(logits[0], logits[1], atol=2e-4, rtol=2e-4)
