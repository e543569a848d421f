"""The mixture-of-experts families end to end: a tiny random model built with transformers' own
class (gpt-oss, Qwen3-MoE, Qwen2-MoE, Mixtral), served from its safetensors directory and from the
GGUF llama.cpp's converter makes of it: greedy tokens equal transformers', alone, in a batch of 8
and again on prefix-cache hits (gpt-oss's prompts run past its sliding window), and the experts
each token is routed to equal transformers' router's. gpt-oss also as OpenAI ships it: experts in
MXFP4 in its safetensors, read in place. Then the files a user must be told about:
an unknown family with experts, expert counts that disagree with the metadata, experts in a type
nothing computes on."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenway.engine.llm import LLM  # noqa: E402
from tokenway.models import expert_kernels  # noqa: E402
from tokenway.models.config import ModelConfig  # noqa: E402
from tokenway.models.decoder import DecoderForCausalLM  # noqa: E402
from tokenway.models.expert_kernels import ExpertWeights  # noqa: E402
from tokenway.models.experts import SparseMoe  # noqa: E402
from tokenway.models.loader import resolve_model  # noqa: E402
from tokenway.protocol.sampling import SamplingParams  # noqa: E402

VOCAB = 49152  # the default model's tokenizer, copied in (the converter needs a real one)
WINDOW = 8  # gpt-oss's sliding layers: the longer prompts and their replies slide past it
MAX_TOKENS = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def family_config(kind: str):
    if kind == "gpt_oss":  # layer 0 slides, layer 1 attends to everything
        return transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=8,
                                         num_experts_per_tok=4, head_dim=16, sliding_window=WINDOW)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                           head_dim=32, norm_topk_prob=True)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)
    if kind == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2)
    raise AssertionError(kind)


FAMILIES = ["gpt_oss", "qwen3_moe", "qwen2_moe", "mixtral"]


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 6, 8, 9, 14, 20, 27, 33]  # below, at and past the window
    return [torch.randint(100, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def build(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(family_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # uneven norms, biases and sinks, so a forgotten one shows
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routers far from uniform: routing ties would make the comparison luck
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


class Family:
    """One family's tiny model, its GGUF and transformers' greedy tokens, made once a session."""

    def __init__(self, kind: str, root: Path, tokenizer_dir: Path, converter: Path) -> None:
        self.kind = kind
        self.model_dir = build(kind, root / kind, tokenizer_dir)
        self.gguf = root / f"{kind}.gguf"
        converted = subprocess.run([sys.executable, str(converter), str(self.model_dir), "--outtype", "f32",
                                    "--outfile", str(self.gguf)], capture_output=True, text=True, timeout=300)
        assert converted.returncode == 0, converted.stderr[-2000:]
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.expected = []
        with torch.inference_mode():
            for ids in prompts():
                out = self.hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                       do_sample=False, pad_token_id=0)
                self.expected.append(out[0, len(ids):].tolist())


@pytest.fixture(scope="module")
def families(tmp_path_factory, tokenizer_dir, converter) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("moe")
    return {kind: Family(kind, root, tokenizer_dir, converter) for kind in FAMILIES}


def engine(model: str, cache_dir: Path) -> LLM:
    return LLM(model, dtype="float32", block_size=4, kv_cache_memory=64 * 2**20, max_model_len=128,
               linear_kernels="default", cache_dir=str(cache_dir), show_progress=False)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_equal_transformers_alone_batched_and_cached(families, kind, source, tmp_path):
    family = families[kind]
    llm = engine(str(family.model_dir if source == "safetensors" else family.gguf), tmp_path / "cache")
    assert llm.engine.model_config.arch.experts is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": ids} for ids in prompts()]
    alone = llm.generate(batch[-1:], params)[0]
    assert list(alone.outputs[0].token_ids) == family.expected[-1], "alone"
    for attempt in ("batch of 8", "prefix-cache hits"):
        outputs = llm.generate(batch, params)
        for index, output in enumerate(outputs):
            assert list(output.outputs[0].token_ids) == family.expected[index], f"{attempt}: prompt {index}"
    assert llm.engine.kv_manager.num_hit_tokens > 0


@pytest.mark.parametrize("kind", FAMILIES)
def test_tokens_go_to_the_experts_transformers_routes_them_to(families, kind, tmp_path):
    family = families[kind]
    prompt = prompts()[-1]
    theirs: list[torch.Tensor] = []

    def record_hf(module, args, output):
        theirs.append(next(t for t in output if not t.is_floating_point()))

    hooks = [layer.mlp.router.register_forward_hook(record_hf) if kind == "gpt_oss"
             else layer.mlp.gate.register_forward_hook(record_hf) for layer in family.hf.model.layers]
    try:
        with torch.inference_mode():
            family.hf(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()

    llm = engine(str(family.gguf), tmp_path / "cache")
    ours: list[torch.Tensor] = []
    for layer in llm.engine.model.decoder_layers:
        moe = layer.mlp
        assert isinstance(moe, SparseMoe)
        route = moe.route

        def recording(hidden, route=route):
            ids, weights = route(hidden)
            ours.append(ids)
            return ids, weights

        moe.route = recording  # type: ignore[method-assign]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    assert len(ours) == len(theirs) == COMMON["num_hidden_layers"]  # the prompt's one prefill step
    for layer, (mine, reference) in enumerate(zip(ours, theirs)):
        assert mine.shape == (len(prompt), family_config(kind).num_experts_per_tok)
        assert torch.equal(mine.sort(dim=-1).values, reference.reshape(mine.shape).sort(dim=-1).values), layer


def patched(source: Path, out: Path, replacements: list[tuple[bytes, bytes]]) -> Path:
    """A copy of a GGUF with byte strings of its header replaced (same lengths)."""
    data = bytearray(source.read_bytes())
    for old, new in replacements:
        assert len(old) == len(new) and old in data
        data = data.replace(old, new)
    out.write_bytes(bytes(data))
    return out


def test_an_unknown_family_with_experts_is_named_with_the_supported_list(families, tmp_path):
    path = patched(families["qwen3_moe"].gguf, tmp_path / "other.gguf", [(b"qwen3moe", b"qwen9moe")])
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'qwen9moe' \(a mixture of 16 experts\); "
                                         r"expected one of \[.*'gpt-oss'.*'qwen3moe'\]") as exc:
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in str(exc.value)


def test_expert_counts_that_disagree_with_the_metadata_are_refused_at_load(families, tmp_path):
    key = b"qwen3moe.expert_count"
    uint32 = struct.pack("<I", 4)  # GGUF value type 4: uint32
    path = patched(families["qwen3_moe"].gguf, tmp_path / "miscounted.gguf",
                   [(key + uint32 + struct.pack("<I", 16), key + uint32 + struct.pack("<I", 12))])
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_\w+\.weight has shape \[[0-9, ]*16\] \(GGUF order\), "
                                         r"which does not fit qwen3moe\.expert_count = 12 experts"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")


def test_experts_in_a_type_nothing_computes_on_name_the_tensor_and_its_type(families):
    config = ModelConfig.from_dir(families["mixtral"].model_dir)
    model = DecoderForCausalLM(config)
    num_experts, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    tensors = {f"model.layers.0.mlp.experts.{proj}_proj.weight":
               ExpertWeights("IQ2_XXS", torch.zeros(num_experts, rows, 66 * cols // 256, dtype=torch.uint8),
                             (num_experts, rows, cols))
               for proj, rows, cols in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter))}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_proj\.weight: experts stored as "
                                         r"IQ2_XXS, a type tokenway cannot compute on"):
        model.use_experts(tensors)


def test_a_harmony_vocabulary_ends_generation_on_return_and_call_not_on_end():
    from tokenway.models.gguf import _end_of_generation

    tokens = ["a"] * 8 + ["<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|message|>"]

    class Meta:
        def get(self, key, default=None):
            return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eot_token_id": 10}.get(key, default)

    assert _end_of_generation(Meta(), 9) == [9, 8, 11]  # eos <|return|>, <|endoftext|>, <|call|>; no <|end|>
    tokens[9] = "b"  # no <|return|>: a vocabulary where <|end|> does end a turn (Phi-3's) keeps it
    assert 10 in _end_of_generation(Meta(), None)


def hf_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float (..., cols) -> gpt-oss's safetensors MXFP4 of it (gguf-py's quantization, relaid):
    blocks uint8 (..., cols / 32, 16), byte j elements 2j (low nibble) and 2j + 1 (high), and
    E8M0 scales uint8 (..., cols / 32)."""
    *lead, cols = weight.shape
    ggml = gguf.quants.quantize(weight.reshape(-1, cols).numpy().astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    ggml = ggml.reshape(*lead, cols // 32, 17)
    codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-1)  # elements 0..31 in order
    pairs = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(pairs), torch.from_numpy(ggml[..., 0].copy())


class Mxfp4GptOss:
    """The tiny gpt-oss as OpenAI's checkpoints are: each layer's gate_up_proj and down_proj as
    _blocks and _scales (rows the output features), config.json's quantization_config mxfp4; its
    GGUF by llama.cpp's converter; transformers' greedy tokens (it dequantizes the experts)."""

    def __init__(self, family: Family, root: Path, converter: Path) -> None:
        from safetensors.torch import load_file, save_file

        self.model_dir = root / "gpt_oss_mxfp4"
        self.model_dir.mkdir()
        tensors = {}
        for file in family.model_dir.glob("*.safetensors"):
            for name, tensor in load_file(file).items():
                if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # (E, in, out) in HF
                    tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = hf_mxfp4(tensor.transpose(1, 2))
                else:
                    tensors[name] = tensor
        save_file(tensors, self.model_dir / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((family.model_dir / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (self.model_dir / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (family.model_dir / name).is_file():
                shutil.copy(family.model_dir / name, self.model_dir / name)
        self.gguf = root / "gpt_oss_mxfp4.gguf"
        converted = subprocess.run([sys.executable, str(converter), str(self.model_dir), "--outtype", "f32",
                                    "--outfile", str(self.gguf)], capture_output=True, text=True, timeout=300)
        assert converted.returncode == 0, converted.stderr[-2000:]
        hf = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.expected = []
        with torch.inference_mode():
            for ids in prompts():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                  do_sample=False, pad_token_id=0)
                self.expected.append(out[0, len(ids):].tolist())


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(families, tmp_path_factory, converter) -> Mxfp4GptOss:
    return Mxfp4GptOss(families["gpt_oss"], tmp_path_factory.mktemp("mxfp4"), converter)


def greedy(llm: LLM, attempts: int = 2) -> list[list[list[int]]]:
    """Each prompt's greedy tokens alone (the last), then the batch of 8 `attempts` times."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": ids} for ids in prompts()]
    runs = [[list(llm.generate(batch[-1:], params)[0].outputs[0].token_ids)]]
    for _ in range(attempts):
        runs.append([list(output.outputs[0].token_ids) for output in llm.generate(batch, params)])
    return runs


def stored_experts(llm: LLM) -> list[expert_kernels.ExpertWeights]:
    return [weights for layer in llm.engine.model.decoder_layers for weights in layer.mlp.stored]


def test_gpt_oss_mxfp4_safetensors_equal_transformers(gpt_oss_mxfp4, monkeypatch, tmp_path):
    """OpenAI's layout read in place, its experts computed on the float weights they stand for
    (the torch kernel: activations unrounded, as transformers computes): transformers' tokens,
    alone, batched and on prefix hits."""
    monkeypatch.setattr(expert_kernels, "supports", lambda qtype, in_features=None: False)
    llm = engine(str(gpt_oss_mxfp4.model_dir), tmp_path / "cache")
    stored = stored_experts(llm)
    assert stored and all(w.qtype == "MXFP4_HF" and w.scales is not None for w in stored)
    assert not stored[0].blocks.is_contiguous()  # the gate: every other row of the file's gate_up, in place
    runs = greedy(llm)
    assert runs[0] == [gpt_oss_mxfp4.expected[-1]]
    for run in runs[1:]:
        assert run == gpt_oss_mxfp4.expected
    assert llm.engine.kv_manager.num_hit_tokens > 0


def test_gpt_oss_mxfp4_safetensors_run_as_its_gguf_does(gpt_oss_mxfp4, tmp_path):
    """The native kernel on the safetensors' blocks where they lie (nibble pairs, scales apart,
    gate and up two rows apart) and on the GGUF llama.cpp's converter relays them into: the same
    weights and the same int8 rounding, so the same greedy tokens."""
    from_safetensors = engine(str(gpt_oss_mxfp4.model_dir), tmp_path / "a")
    kernels = [layer.mlp.kernel for layer in from_safetensors.engine.model.decoder_layers]
    assert all(isinstance(k, expert_kernels.NativeExpertKernel) and k.gate.qtype == "MXFP4_HF" for k in kernels)
    assert kernels[0].gate.blocks.data_ptr() == stored_experts(from_safetensors)[0].blocks.data_ptr()
    from_gguf = engine(str(gpt_oss_mxfp4.gguf), tmp_path / "b")
    assert all(k.gate.qtype == "MXFP4" for k in (layer.mlp.kernel for layer in from_gguf.engine.model.decoder_layers))
    assert greedy(from_safetensors) == greedy(from_gguf)
