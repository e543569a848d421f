"""resolve_model / iter_weights, and the GGUF -> HF conversion checked against transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tokenway.models.loader as loader
from tokenway.models.config import ModelConfig
from tokenway.models.gguf import CONVERTER_VERSION, TENSOR_TABLE
from tokenway.models.loader import DEFAULT_MODEL, resolve_model
from tokenway.models.weights import iter_weights, quantized_weights


@pytest.fixture(scope="session")
def cache_dir(model_cache_dir) -> Path:
    return model_cache_dir  # tests/conftest.py: the session's cache, never ~/.cache


@pytest.fixture(scope="session")
def converted_dir(default_model_dir) -> Path:
    return default_model_dir


@pytest.fixture(scope="session")
def reference_model(hf_reference):
    return hf_reference


def test_default_model_is_described_in_the_cache_without_a_copy_of_its_weights(converted_dir, cache_dir, gguf_path):
    assert converted_dir.parent == cache_dir / "gguf"
    assert converted_dir.name.endswith(f"-v{CONVERTER_VERSION}")
    names = {p.name for p in converted_dir.iterdir() if not p.name.startswith("relaid-")}  # the kernels' own cache
    assert names == {"config.json", "generation_config.json", TENSOR_TABLE, "tokenizer.json", "tokenizer_config.json"}
    described = sum(p.stat().st_size for p in converted_dir.iterdir() if not p.name.startswith("relaid-"))
    assert described < gguf_path.stat().st_size / 10  # JSON, not weights
    assert not [p for p in cache_dir.joinpath("gguf").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_mapped_blocks_dequantize_to_the_float_weights(converted_dir, gguf_path):
    """The quantized blocks, mapped from the GGUF, are the float weights iter_weights decodes, row for
    row (q/k un-permuted as whole block rows), and those of the GGUF itself (not copies)."""
    kept = quantized_weights(converted_dir)
    assert {t.qtype for t in kept.values()} == {"Q4_1", "Q8_0"}
    assert len(kept) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer + the embedding
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight")
    floats = dict(iter_weights(converted_dir, skip=set(kept) - set(names)))
    for name in names:
        tensor = kept[name]
        qtype = gguf.GGMLQuantizationType[tensor.qtype]
        dequantized = gguf.quants.dequantize(tensor.blocks.numpy(), qtype).reshape(tensor.shape)
        assert torch.equal(torch.from_numpy(dequantized), floats[name]), name
    reader = gguf.GGUFReader(gguf_path)
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert np.array_equal(kept["model.layers.0.mlp.down_proj.weight"].blocks.numpy().reshape(-1),
                          np.asarray(down.data).reshape(-1).view(np.uint8))


def test_alias_is_case_insensitive(converted_dir, cache_dir):
    assert resolve_model("SmolLM2-135M-Instruct", cache_dir=cache_dir) == converted_dir


def test_config_matches_transformers(converted_dir, reference_model):
    ours = ModelConfig.from_dir(converted_dir)
    ref = reference_model.config
    assert ours.architecture == "LlamaForCausalLM"
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.rope.theta == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.rope.rope_type == "default" and ours.local_rope is None
    # <|im_end|> (2, the GGUF's eos) and <|endoftext|> (0), which llama.cpp ends generation on too.
    assert ours.eos_token_ids == (ref.eos_token_id, 0) == (2, 0)
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 0]}


def test_tensors_match_transformers(converted_dir, reference_model):
    # transformers un-permutes q/k itself, so equality here checks our inverse of llama.cpp's permute.
    expected = reference_model.state_dict()
    ours = dict(iter_weights(converted_dir))
    # Tied embeddings: transformers lists lm_head.weight as a view of embed_tokens; the file has no copy.
    assert set(ours) | {"lm_head.weight"} == set(expected)
    assert "lm_head.weight" not in ours
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_second_resolve_uses_the_cache(converted_dir, cache_dir, gguf_path, monkeypatch):
    weights = converted_dir / TENSOR_TABLE
    mtime_ns = weights.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the cached conversion should be reused without reading the GGUF")

    monkeypatch.setattr(loader, "convert_gguf", fail)
    monkeypatch.setattr(gguf, "GGUFReader", fail)
    assert resolve_model(str(gguf_path), cache_dir=cache_dir) == converted_dir
    assert resolve_model(DEFAULT_MODEL) == converted_dir  # cache dir from TOKENWAY_CACHE_DIR
    assert weights.stat().st_mtime_ns == mtime_ns


def test_failed_conversion_leaves_no_cache_entry(gguf_path, tmp_path, monkeypatch):
    def crash(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(loader, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model(str(gguf_path), cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_conversion_removes_temporaries_of_dead_processes(gguf_path, tmp_path, monkeypatch):
    def fake_convert(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    first = resolve_model(str(gguf_path), cache_dir=tmp_path)
    first.rename(first.with_name("moved"))
    dead = tmp_path / "gguf" / f".{first.name}.999999999.abc"  # above any pid_max
    alive = tmp_path / "gguf" / f".{first.name}.{os.getpid()}.abc"
    dead.mkdir()
    alive.mkdir()
    assert resolve_model(str(gguf_path), cache_dir=tmp_path) == first
    assert not dead.exists()
    assert alive.exists()


# A tiny llama GGUF, written the way llama.cpp's converter writes one.
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, FFN = 16, 4, 2, 4, 32
TOKENS = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "abc", "Ġa"]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    return {
        "model.embed_tokens.weight": rand(len(TOKENS), HIDDEN),
        "model.layers.0.input_layernorm.weight": rand(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rand(NUM_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": rand(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": rand(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": rand(HIDDEN, NUM_HEADS * HEAD_DIM),
        "model.layers.0.post_attention_layernorm.weight": rand(HIDDEN),
        "model.layers.0.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, FFN),
        "model.norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(len(TOKENS), HIDDEN),
    }


def _write_tiny_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", pre: str = "smollm", **extra):
    hf = _tiny_hf_weights()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(1)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] + [1] * (len(TOKENS) - 1))
    writer.add_token_merges(["a b", "ab c", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    gguf_names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for hf_name, w in hf.items():
        if hf_name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, NUM_HEADS)
        elif hf_name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, NUM_KV_HEADS)
        writer.add_tensor(gguf_names[hf_name], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_gguf_round_trips_to_the_hf_weights(tmp_path):
    hf = _write_tiny_gguf(tmp_path / "tiny.gguf", rope_scaling_type=gguf.RopeScalingType.LINEAR,
                          rope_scaling_factor=2.0)
    model_dir = resolve_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    ours = dict(iter_weights(model_dir))
    assert set(ours) == set(hf)
    for name, w in hf.items():
        assert torch.equal(ours[name], torch.from_numpy(w)), name
    config = ModelConfig.from_dir(model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 4)
    assert config.tie_word_embeddings is False
    assert (config.rope.rope_type, config.rope.params) == ("linear", {"factor": 2.0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, r"unsupported GGUF architecture 'gpt2'; expected one of "
                           r"\['gemma3', 'gpt-oss', 'llama', 'phi3', 'qwen2', 'qwen2moe', 'qwen3', "
                           r"'qwen3moe'\]"),
        ({"tokenizer_model": "bert"}, r"unsupported tokenizer.ggml.model 'bert'"),
        ({"pre": "deepseek-llm"}, r"unsupported tokenizer.ggml.pre 'deepseek-llm'"),
        ({"rope_scaling_type": gguf.RopeScalingType.LONGROPE, "rope_scaling_factor": 4.0},
         r"unsupported rope scaling type 'longrope'"),
    ],
)
def test_unsupported_gguf_is_rejected_naming_the_file(tmp_path, kwargs, message):
    path = tmp_path / "model.gguf"
    _write_tiny_gguf(path, **kwargs)
    with pytest.raises(ValueError, match=message) as exc:
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in str(exc.value)
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def _save_tiny_hf(model_dir: Path, config) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(model_dir)
    return model.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_directory_resolves_to_itself(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    shape = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    config = transformers.LlamaConfig(**shape) if family == "llama" else transformers.Qwen2Config(**shape)
    expected = _save_tiny_hf(tmp_path, config)
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    ours = dict(iter_weights(tmp_path))
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    assert ("model.layers.0.self_attn.q_proj.bias" in ours) == (family == "qwen2")


def test_nonexistent_path(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(ValueError, match="no such file or directory; expected a model alias") as exc:
        resolve_model(str(path))
    assert str(path) in str(exc.value)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="has no config.json") as exc:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(exc.value)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file") as exc:
        resolve_model(str(path))
    assert str(path) in str(exc.value)


def test_truncated_gguf(tmp_path, gguf_path):
    path = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        path.write_bytes(f.read(1000))
    with pytest.raises(ValueError, match="not a valid GGUF file") as exc:
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in str(exc.value)
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_unsupported_hf_architecture(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture") as exc:
        resolve_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(exc.value)


def test_iter_weights_without_safetensors(tmp_path):
    with pytest.raises(ValueError, match=r"no \*.safetensors files") as exc:
        next(iter_weights(tmp_path))
    assert str(tmp_path) in str(exc.value)
