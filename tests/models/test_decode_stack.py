"""A decode-only step's layers in one native call (models/decode_stack.py, csrc/layers.cpp):
it serves exactly the steps it should, and its logits are the Python layer loop's bit for bit,
with biases, every block type the kernel reads, a prefix shared by several rows (cascade attention) and
both kinds of products."""

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
from tokenway.models.weights import QuantizedTensor
from tokenway.protocol.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not quant.available(), reason="the quant kernel has no vector path on this CPU")

BLOCK_SIZE = 4
# Per layer, the block type of each matmul: a stack holds every type the kernel reads, K-quants
# beside the 32-weight ones, as a Q4_K_M file's layers do, and (layer 0) a fused q/k/v of two
# types, as half a Q4_K_M file's layers have (Q6_K v beside Q4_K q and k).
QTYPES = [
    {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_0", "gate_proj": "Q6_K", "up_proj": "Q6_K",
     "down_proj": "Q5_K"},
    {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q8_0", "gate_proj": "Q8_0", "up_proj": "Q8_0",
     "down_proj": "Q4_1"},
    {"q_proj": "Q6_K", "k_proj": "Q6_K", "v_proj": "Q6_K", "o_proj": "Q4_0", "gate_proj": "Q5_1", "up_proj": "Q5_1",
     "down_proj": "Q4_K"},
]
HIDDEN, INTERMEDIATE = 256, 512  # whole K-quant super-blocks


def blocks_for(weight: torch.Tensor, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """gguf-py's quantization of the weight where it has one; K-quants: random valid blocks
    whose weights are of a trained layer's size (d, dmin ~ 1e-4; Q6_K's scales within 32)."""
    if qtype not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[qtype])
    rows, cols = weight.shape
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows, cols // 256, type_size), dtype=np.uint8)
    scales = rng.uniform(6.2e-5, 1.2e-4, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[..., 192:208] = rng.integers(-32, 32, (rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = scales[..., :2]
    else:
        blocks[..., 0:4] = scales
    return blocks.reshape(rows, -1)


def tiny_quantized(dtype: torch.dtype, activations: str) -> DecoderForCausalLM:
    """A tiny Qwen2 (q/k/v biases, non-zero) whose layers' matmuls run on GGUF blocks."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {name: p.detach().clone() for name, p in hf.state_dict().items()}
    for name, p in state.items():
        if name.endswith("bias"):
            p.normal_(0, 0.5)
    blocks = {}
    for name, weight in state.items():
        kind = name.split(".")[-2]
        if name.startswith("model.layers.") and kind in QTYPES[0] and name.endswith("weight"):
            qtype = QTYPES[int(name.split(".")[2])][kind]
            data = blocks_for(weight, qtype, rng)
            blocks[name] = QuantizedTensor(qtype, torch.from_numpy(data), tuple(weight.shape))
    model = DecoderForCausalLM(ModelConfig.from_dict(cfg.to_dict()), dtype)
    used = model.use_quantized(blocks, activations)
    model.load_weights((name, p) for name, p in state.items() if name not in used)
    if not model.use_fused_kernels():
        pytest.skip("the fused kernels do not build here")
    return model.eval()


def step(runner: ModelRunner, requests, chunks, tables, native: bool) -> torch.Tensor:
    """Run one step (without advancing the requests): with the stack where it serves, or the Python loop."""
    model = runner.model
    stack = model.decode_stack
    model.decode_stack = stack if native else None
    try:
        return runner.execute(SchedulerOutput(list(requests), list(chunks), [list(t) for t in tables]))
    finally:
        model.decode_stack = stack


def advance(requests, chunks) -> None:
    for request, num_new in zip(requests, chunks):
        request.num_computed_tokens += num_new


PRODUCTS = [(torch.float32, "dtype"), (torch.bfloat16, "int8")]


@pytest.mark.parametrize("dtype,activations", PRODUCTS, ids=["float32-products", "int8-products"])
def test_decode_steps_equal_the_python_loop(dtype, activations, monkeypatch):
    if activations == "int8" and quant.products_for(dtype, "int8") != "int8":
        pytest.skip("no AVX512-VNNI: no int8 products")
    model = tiny_quantized(dtype, activations)
    runner = ModelRunner(model, num_blocks=48, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    if runner.decode_kernel is None:
        pytest.skip("the native attention kernel does not build here")
    assert runner.native_layers and isinstance(model.decode_stack, DecodeStack)
    # Each matmul's parts: one kernel, or one a block type of a fused matmul (layer 0's q/k/v).
    assert [[kernel.qtype for kernel in parts] for parts in model.decode_stack.matmuls] == [
        ["Q4_K", "Q4_K", "Q6_K"], ["Q5_0"], ["Q6_K"], ["Q5_K"],
        ["Q4_1"], ["Q8_0"], ["Q8_0"], ["Q4_1"],
        ["Q6_K"], ["Q4_0"], ["Q5_1"], ["Q4_K"]]
    groups = []
    shared_prefixes = runner._shared_prefixes
    monkeypatch.setattr(runner, "_shared_prefixes", lambda *args: groups.append(shared_prefixes(*args)) or groups[-1])
    calls = []
    native_call = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *args: calls.append(1) or native_call(self, *args))

    torch.manual_seed(1)
    prefix = torch.randint(0, 96, (9,)).tolist()  # two whole shared blocks and one token more
    own = [torch.randint(0, 96, (n,)).tolist() for n in (5, 3, 8)]
    requests = [Request(f"r{i}", prefix + tokens, SamplingParams(temperature=0)) for i, tokens in enumerate(own)]
    # Rows 1 and 2 hold row 0's prefix.
    tables = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 10, 11, 12, 13], [0, 1, 20, 21, 22, 23, 24]]
    # Row 0's prompt fills the shared blocks; rows 1 and 2 start after them, as a prefix-cache hit would.
    step(runner, requests[:1], [len(requests[0].prompt_token_ids)], tables[:1], native=True)
    advance(requests[:1], [len(requests[0].prompt_token_ids)])
    for request, table in zip(requests[1:], tables[1:]):
        request.num_computed_tokens = 8
        step(runner, [request], [request.num_tokens - 8], [table], native=True)
        request.num_computed_tokens = request.num_tokens
    assert calls == []  # prompt chunks run the Python loop

    for position in range(6):
        for request in requests:
            request.append_output_token_ids((position * 7 + len(request.request_id)) % 96)
        chunks = [1] * len(requests)
        got = step(runner, requests, chunks, tables, native=True)
        assert len(calls) == position + 1
        want = step(runner, requests, chunks, tables, native=False)  # rewrites the same K/V
        assert len(calls) == position + 1
        assert torch.equal(got, want)
        assert groups[-1] == [([0, 1, 2], 2)]  # the three rows read their two shared blocks once (cascade)
        advance(requests, chunks)

    # A step with a prompt chunk among the decodes is the Python loop's.
    late = Request("late", torch.randint(0, 96, (6,)).tolist(), SamplingParams(temperature=0))
    for request in requests:
        request.append_output_token_ids(5)
    step(runner, requests + [late], [1, 1, 1, 6], tables + [[30, 31]], native=True)
    assert len(calls) == 6


def test_no_stack_where_a_layer_cannot_run_in_it():
    model = tiny_quantized(torch.float32, "dtype")
    runner_caches = [(torch.zeros(8, 2, 64), torch.zeros(8, 2, 64)) for _ in model.layers]
    assert model.use_decode_stack(runner_caches, BLOCK_SIZE)  # every layer on blocks: built
    # A float weight in one layer: no stack, every step runs the Python loop.
    from tokenway.models.linear import LinearKernel

    model.layers[1].mlp.down = LinearKernel(torch.nn.Parameter(torch.zeros(HIDDEN, INTERMEDIATE), requires_grad=False))
    assert not model.use_decode_stack(runner_caches, BLOCK_SIZE) and model.decode_stack is None


@pytest.mark.parametrize("native", [True, False], ids=["native-stack", "python-loop"])
def test_an_interjection_runs_between_layers_and_leaves_the_step_as_it_was(native):
    """A step stopped between two layers while its interjection's descriptor is readable, whose
    run() then runs a whole step of other requests, goes on to the same logits as a step left
    alone: the layers it runs and the KV it writes are the same."""
    import os

    from tokenway.models.interjection import Interjection

    model = tiny_quantized(torch.float32, "dtype")
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    if runner.decode_kernel is None:
        pytest.skip("the native attention kernel does not build here")
    torch.manual_seed(2)
    requests = [Request(f"r{i}", torch.randint(0, 96, (n,)).tolist(), SamplingParams(temperature=0))
                for i, n in enumerate((6, 9))]
    tables = [[0, 1, 2, 3], [10, 11, 12, 13]]
    step(runner, requests, [6, 9], tables, native=True)
    advance(requests, [6, 9])
    other = Request("other", torch.randint(0, 96, (7,)).tolist(), SamplingParams(temperature=0))

    read_fd, write_fd = os.pipe()
    layers_run: list[int] = []
    other_logits: list[torch.Tensor] = []

    def run() -> None:
        if not select_readable(read_fd):
            return
        os.read(read_fd, 1)
        layers_run.append(len(layers_run))
        # The interjected step: another request's prompt, in blocks of its own.
        other_logits.append(step(runner, [other], [7], [[30, 31]], native=native))
        if len(layers_run) < 2:
            os.write(write_fd, b"x")  # wake it again at the next boundary

    try:
        for request in requests:
            request.append_output_token_ids(3)
        want = step(runner, requests, [1, 1], tables, native=native)  # alone first; the same KV is rewritten
        os.write(write_fd, b"x")
        model.decode_stack = model.decode_stack if native else None
        got = runner.execute(SchedulerOutput(list(requests), [1, 1], [list(t) for t in tables]),
                             Interjection(read_fd, run))
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert layers_run == [0, 1]  # woken twice, at two boundaries of one 3-layer step
    assert torch.equal(got, want)
    assert torch.equal(other_logits[0], other_logits[1])


def select_readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])
