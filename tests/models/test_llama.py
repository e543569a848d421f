"""The decoder against transformers' own implementation, on tiny random models of each
supported family, through the paged runner: whole prefill, chunked prefill, decode steps
over a shuffled block table, and a mixed batch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenway.engine.request import Request  # noqa: E402
from tokenway.engine.runner import ModelRunner  # noqa: E402
from tokenway.engine.scheduler import SchedulerOutput  # noqa: E402
from tokenway.models.config import ModelConfig  # noqa: E402
from tokenway.models.decoder import DecoderForCausalLM  # noqa: E402
from tokenway.protocol.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 4
WINDOW = 6  # keys a sliding layer sees: less than two blocks, so windows start mid-block
FAMILIES = ["llama", "llama3-rope", "linear-rope", "yarn-rope", "qwen2", "qwen2-window", "mistral", "mistral-window",
            "qwen3", "gemma3", "phi3", "phi3-window"]
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**COMMON, rope_theta=10000.0)
    elif kind == "llama3-rope":
        cfg = transformers.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif kind == "linear-rope":
        cfg = transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                  "factor": 2.0})
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**COMMON, sliding_window=None)
    elif kind == "mistral-window":  # every layer slides: 40 tokens cross a 6-key window many times
        cfg = transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    elif kind == "yarn-rope":
        cfg = transformers.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})
    elif kind == "qwen2-window":  # layers from max_window_layers on slide
        cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    elif kind == "gemma3":  # local layers with a 6-key window at base 10k, a global one at 1M with linear scaling
        cfg = transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=3.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})
    elif kind == "phi3":
        cfg = transformers.Phi3Config(**COMMON, pad_token_id=0)
    elif kind == "phi3-window":
        cfg = transformers.Phi3Config(**COMMON, pad_token_id=0, sliding_window=WINDOW)
    else:
        raise AssertionError(kind)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Make biases non-zero and norms uneven so a forgotten bias or norm shows.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    config = ModelConfig.from_dict(cfg.to_dict())
    ours = DecoderForCausalLM(config, torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0]


def run_step(runner: ModelRunner, requests, chunks, tables) -> torch.Tensor:
    out = SchedulerOutput(list(requests), list(chunks), [list(t) for t in tables])
    logits = runner.execute(out)
    for request, num_new in zip(requests, chunks):
        request.num_computed_tokens += num_new
    return logits


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-operators"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_chunks_and_decode_match_transformers(kind, native):
    """native: the C++ decode attention and fused layer kernels; else torch operators only."""
    hf, ours = tiny(kind)
    if native and not ours.use_fused_kernels():
        pytest.skip("the native kernels do not build here")
    torch.manual_seed(1)
    tokens = torch.randint(0, 96, (40,)).tolist()
    expected = hf_logits(hf, tokens)  # (40, vocab)

    runner = ModelRunner(ours, num_blocks=32, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                         native_attention=native)
    if native and runner.decode_kernel is None:
        pytest.skip("the native attention kernel does not build here")
    table = list(range(31, 31 - 10, -1))  # blocks out of order: paging must not matter
    request = Request("r", tokens[:25], SamplingParams(temperature=0))
    # A 25-token prompt in chunks of 7, 7 and 11: only the last chunk yields logits.
    assert run_step(runner, [request], [7], [table]).shape[0] == 0
    assert run_step(runner, [request], [7], [table]).shape[0] == 0
    got = run_step(runner, [request], [11], [table])
    torch.testing.assert_close(got[0], expected[24], atol=1e-4, rtol=1e-4)
    for position in range(25, 40):
        request.append_output_token_ids(tokens[position])
        got = run_step(runner, [request], [1], [table])
        torch.testing.assert_close(got[0], expected[position], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-operators"])
@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral-window"])
def test_mixed_batch_matches_each_alone(native, kind):
    hf, ours = tiny(kind)
    if native and not ours.use_fused_kernels():
        pytest.skip("the native kernels do not build here")
    torch.manual_seed(2)
    a_tokens = torch.randint(0, 96, (18,)).tolist()
    b_tokens = torch.randint(0, 96, (9,)).tolist()
    c_tokens = torch.randint(0, 96, (13,)).tolist()
    runner = ModelRunner(ours, num_blocks=32, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                         native_attention=native)
    a = Request("a", a_tokens[:17], SamplingParams(temperature=0))
    b = Request("b", b_tokens[:8], SamplingParams(temperature=0))
    c = Request("c", c_tokens, SamplingParams(temperature=0))
    tables = {"a": [0, 1, 2, 3, 4], "b": [10, 11, 12], "c": [20, 21, 22, 23]}
    run_step(runner, [a, b], [17, 8], [tables["a"], tables["b"]])
    a.append_output_token_ids(a_tokens[17])
    b.append_output_token_ids(b_tokens[8])
    # Two decodes and a fresh prefill in one step.
    logits = run_step(runner, [a, c, b], [1, 13, 1], [tables["a"], tables["c"], tables["b"]])
    torch.testing.assert_close(logits[0], hf_logits(hf, a_tokens)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(hf, c_tokens)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2], hf_logits(hf, b_tokens)[-1], atol=1e-4, rtol=1e-4)


def test_missing_and_misshapen_weights_are_named():
    hf, ours = tiny("llama")
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_weight"):
        DecoderForCausalLM(ours.config).load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        DecoderForCausalLM(ours.config).load_weights(state.items())
