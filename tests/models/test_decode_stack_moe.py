"""The native decode stack (models/decode_stack.py, csrc/layers.cpp) on the families whose layers
go beyond Llama's: Qwen3's QK-norm, and the mixtures of experts (Qwen3-MoE: softmax, top-k,
renormalised; Qwen2-MoE: a shared expert gated by a sigmoid, beside a dense layer; Mixtral). Each
tiny model is built with transformers' own class, its matmuls and experts on Q8_0 blocks as a
GGUF stores them; decode steps through the stack give the Python layer loop's logits bit for bit."""

from __future__ import annotations

import gguf  # a dependency of tokenway itself (models/quant.py imports it)
import numpy as np
import pytest
import torch

from tokenway.engine.request import Request
from tokenway.engine.runner import ModelRunner
from tokenway.engine.scheduler import SchedulerOutput
from tokenway.models import quant
from tokenway.models.config import ModelConfig
from tokenway.models.decode_stack import DecodeStack
from tokenway.models.decoder import DecoderForCausalLM
from tokenway.models.expert_kernels import ExpertWeights, NativeExpertKernel, TorchExpertKernel
from tokenway.models.experts import SparseMoe
from tokenway.models.weights import QuantizedTensor
from tokenway.protocol.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not quant.available(), reason="the quant kernel has no vector path on this CPU")

BLOCK_SIZE = 4
VOCAB = 96
# Hidden sizes and intermediates are multiples of 32: whole Q8_0 blocks.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def family_config(kind: str):
    if kind == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=32)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                           head_dim=32, norm_topk_prob=True)
    if kind == "qwen2_moe":  # layer 1 dense (mlp_only_layers): a stack holds both kinds of MLP
        return transformers.Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64, mlp_only_layers=[1])
    if kind == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2)
    raise AssertionError(kind)


FAMILIES = ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral"]


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """(..., in_features) float -> uint8 Q8_0 blocks (..., bytes a row), gguf-py's quantization."""
    rows = weight.reshape(-1, weight.shape[-1]).numpy()
    blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(blocks)).reshape(*weight.shape[:-1], -1)


def tiny_model(kind: str, experts: str = "native") -> DecoderForCausalLM:
    """A tiny model of the family, every layer matmul and expert on Q8_0 blocks; the head float.
    experts: "native" (csrc/experts.cpp) or "torch" (TorchExpertKernel, which the stack does not run)."""
    torch.manual_seed(0)
    cfg = family_config(kind)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {name: p.detach().clone() for name, p in hf.state_dict().items()}
    for name, p in state.items():  # uneven norms, biases and routers far from uniform, so a forgotten one shows
        if name.endswith("bias"):
            p.normal_(0, 0.5)
        elif "norm" in name:
            p.add_(torch.randn_like(p) * 0.3)
        elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
            p.normal_(0, 0.5)
    config = ModelConfig.from_dict(cfg.to_dict())
    blocks: dict[str, QuantizedTensor] = {}
    stored: dict[str, ExpertWeights] = {}
    for name, weight in list(state.items()):
        if not name.startswith("model.layers."):
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2 * inter, hidden): gate rows, then up rows
            prefix, inter = name.removesuffix("gate_up_proj"), weight.shape[1] // 2
            for proj, part in (("gate", weight[:, :inter]), ("up", weight[:, inter:])):
                stored[f"{prefix}{proj}_proj.weight"] = ExpertWeights("Q8_0", q8_0(part.contiguous()),
                                                                      tuple(part.shape))
            del state[name]
        elif name.endswith("mlp.experts.down_proj"):
            stored[f"{name}.weight"] = ExpertWeights("Q8_0", q8_0(weight), tuple(weight.shape))
            del state[name]
        elif name.endswith("proj.weight") and weight.dim() == 2:
            blocks[name] = QuantizedTensor("Q8_0", q8_0(weight), tuple(weight.shape))
    model = DecoderForCausalLM(config, torch.float32)
    used = model.use_quantized(blocks, "dtype")
    used |= model.use_experts(stored)
    assert used == set(blocks) | set(stored)  # every layer matmul and expert on its blocks
    model.load_weights((name, p) for name, p in state.items() if name not in used)
    if not model.use_fused_kernels():
        pytest.skip("the fused kernels do not build here")
    for layer in model.decoder_layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            if not isinstance(mlp.kernel, NativeExpertKernel):
                pytest.skip("the native experts kernel does not build here")
            if experts == "torch":
                mlp.kernel = TorchExpertKernel(mlp.kernel.gate, mlp.kernel.up, mlp.kernel.down, mlp.kernel.spec)
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, DecoderForCausalLM]:
    return request.param, tiny_model(request.param)


def step(runner: ModelRunner, requests, chunks, tables, native: bool) -> torch.Tensor:
    """Run one step (without advancing the requests): with the stack where it serves, or the Python loop."""
    model = runner.model
    stack = model.decode_stack
    model.decode_stack = stack if native else None
    try:
        return runner.execute(SchedulerOutput(list(requests), list(chunks), [list(t) for t in tables]))
    finally:
        model.decode_stack = stack


def test_decode_steps_equal_the_python_loop(family, monkeypatch):
    kind, model = family
    runner = ModelRunner(model, num_blocks=48, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    if runner.decode_kernel is None:
        pytest.skip("the native attention kernel does not build here")
    assert model.plain_layers and isinstance(model.decode_stack, DecodeStack)
    sparse = [isinstance(layer.mlp, SparseMoe) for layer in model.decoder_layers]
    assert sparse == {"qwen3": [False] * 3, "qwen2_moe": [True, False, True]}.get(kind, [True] * 3)
    # Per layer qkv and o, then a dense MLP's or a shared expert's gate_up and down.
    per_layer = {"qwen3_moe": [2, 2, 2], "mixtral": [2, 2, 2]}.get(kind, [4, 4, 4])
    assert len(model.decode_stack.matmuls) == sum(per_layer)
    calls = []
    native_call = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *args: calls.append(1) or native_call(self, *args))

    torch.manual_seed(1)
    requests = [Request(f"r{i}", torch.randint(0, VOCAB, (n,)).tolist(), SamplingParams(temperature=0))
                for i, n in enumerate((5, 9, 3))]
    tables = [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23]]
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    step(runner, requests, prompt_lens, tables, native=True)
    for request, n in zip(requests, prompt_lens):
        request.num_computed_tokens += n
    assert calls == []  # prompt chunks run the Python loop

    for position in range(5):
        for request in requests:
            request.append_output_token_ids((position * 11 + len(request.request_id) * 5) % VOCAB)
        chunks = [1] * len(requests)
        got = step(runner, requests, chunks, tables, native=True)
        assert len(calls) == position + 1
        want = step(runner, requests, chunks, tables, native=False)  # rewrites the same K/V
        assert len(calls) == position + 1
        assert torch.equal(got, want), f"{kind}: decode step {position}"
        for request in requests:
            request.num_computed_tokens += 1
    # One stream alone, as a chat's decode runs.
    requests[0].append_output_token_ids(7)
    got = step(runner, requests[:1], [1], tables[:1], native=True)
    want = step(runner, requests[:1], [1], tables[:1], native=False)
    assert len(calls) == 6 and torch.equal(got, want)


def test_the_stack_runs_the_routing_and_qk_norm_the_python_loop_runs():
    """The stack follows the model's own weights: changing a layer's router (or its q_norm) after it
    was built changes the stack's logits as it changes the Python loop's, so neither is ignored."""
    for kind, attribute in (("qwen3_moe", "router"), ("qwen3", "q_norm")):
        model = tiny_model(kind)
        runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE, device=torch.device("cpu"))
        if runner.decode_kernel is None:
            pytest.skip("the native attention kernel does not build here")
        request = Request("r", torch.randint(0, VOCAB, (6,)).tolist(), SamplingParams(temperature=0))
        step(runner, [request], [6], [[0, 1]], native=True)
        request.num_computed_tokens = 6
        request.append_output_token_ids(3)
        before = step(runner, [request], [1], [[0, 1]], native=True)
        layer = model.decoder_layers[1]
        if attribute == "router":
            mlp = layer.mlp
            assert isinstance(mlp, SparseMoe)
            mlp.router_weight.data.copy_(torch.flip(mlp.router_weight.data, dims=[0]))  # other experts chosen
        else:
            assert layer.self_attn.q_norm is not None
            layer.self_attn.q_norm.weight.data.mul_(2.0)  # in place: the stack holds the same tensor
        got = step(runner, [request], [1], [[0, 1]], native=True)
        want = step(runner, [request], [1], [[0, 1]], native=False)
        assert torch.equal(got, want) and not torch.equal(got, before), kind


def test_no_stack_where_a_mixture_cannot_run_in_it():
    caches = [(torch.zeros(8, 2, 32), torch.zeros(8, 2, 32)) for _ in range(COMMON["num_hidden_layers"])]
    model = tiny_model("qwen3_moe")
    assert model.use_decode_stack(caches, BLOCK_SIZE)
    # Experts through torch's operators (a GPU's path, or no native build) are not the stack's op.
    model = tiny_model("qwen3_moe", experts="torch")
    assert not model.use_decode_stack(caches, BLOCK_SIZE) and model.decode_stack is None
    # A shared expert on a float weight: every step runs the Python loop.
    from tokenway.models.linear import LinearKernel

    model = tiny_model("qwen2_moe")
    assert model.use_decode_stack(caches, BLOCK_SIZE)
    shared = model.decoder_layers[0].mlp.shared
    assert shared is not None
    shared.down = LinearKernel(torch.nn.Parameter(torch.zeros(64, 64), requires_grad=False))
    assert not model.use_decode_stack(caches, BLOCK_SIZE)


def tiny_gpt_oss() -> DecoderForCausalLM:
    """A tiny gpt-oss: layers 0 and 2 slide (a window of 8), layer 1 attends to everything; sinks,
    q/k/v and output biases, router and expert biases, swiglu_oai. Its attention matmuls on Q8_0
    blocks, its experts float (the native kernel's F32 path)."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=8,
                                    num_experts_per_tok=2, head_dim=16, sliding_window=8)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {name: p.detach().clone() for name, p in hf.state_dict().items()}
    for name, p in state.items():
        if name.endswith(("bias", "sinks")):
            p.normal_(0, 0.5)
        elif "norm" in name:
            p.add_(torch.randn_like(p) * 0.3)
        elif "router" in name:
            p.normal_(0, 0.5)
    config = ModelConfig.from_dict(cfg.to_dict())
    assert [config.is_sliding(layer) for layer in range(3)] == [True, False, True]
    blocks = {name: QuantizedTensor("Q8_0", q8_0(weight), tuple(weight.shape)) for name, weight in state.items()
              if name.startswith("model.layers.") and name.endswith("proj.weight") and weight.dim() == 2}
    model = DecoderForCausalLM(config, torch.float32)
    used = model.use_quantized(blocks, "dtype")
    assert used == set(blocks)
    model.load_weights((name, p) for name, p in state.items() if name not in used)
    if not model.use_fused_kernels():
        pytest.skip("the fused kernels do not build here")
    for layer in model.decoder_layers:
        assert isinstance(layer.mlp, SparseMoe)
        if not isinstance(layer.mlp.kernel, NativeExpertKernel):
            pytest.skip("the native experts kernel does not build here")
    return model.eval()


def test_gpt_oss_decode_steps_past_the_window_equal_the_python_loop(monkeypatch):
    """Sliding layers in blocks of their own (the runner's second KV cache group), full layers in
    theirs, attention sinks and biases: the stack's logits are the Python loop's, also once the
    contexts run past the window."""
    model = tiny_gpt_oss()
    runner = ModelRunner(model, num_blocks=32, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                         num_sliding_blocks=40)
    if runner.decode_kernel is None:
        pytest.skip("the native attention kernel does not build here")
    assert runner.mixed_layers and isinstance(model.decode_stack, DecodeStack) and model.decode_stack.sliding
    calls = []
    native_call = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *args: calls.append(1) or native_call(self, *args))

    def run(requests, chunks, native: bool) -> torch.Tensor:
        stack = model.decode_stack
        model.decode_stack = stack if native else None
        try:
            return runner.execute(SchedulerOutput(list(requests), list(chunks), [list(t) for t in tables],
                                                  sliding_block_tables=[list(t) for t in sliding_tables]))
        finally:
            model.decode_stack = stack

    torch.manual_seed(3)
    requests = [Request(f"r{i}", torch.randint(0, VOCAB, (n,)).tolist(), SamplingParams(temperature=0))
                for i, n in enumerate((5, 9))]
    tables = [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]]
    sliding_tables = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]  # other ids: a mix-up shows
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    run(requests, prompt_lens, native=True)
    for request, n in zip(requests, prompt_lens):
        request.num_computed_tokens += n
    assert calls == []
    for position in range(8):  # contexts of 6..13 and 10..17 keys: past the window of 8
        for request in requests:
            request.append_output_token_ids((position * 13 + 7 * len(request.prompt_token_ids)) % VOCAB)
        got = run(requests, [1, 1], native=True)
        want = run(requests, [1, 1], native=False)
        assert len(calls) == position + 1
        assert torch.equal(got, want), f"decode step {position}"
        for request in requests:
            request.num_computed_tokens += 1
