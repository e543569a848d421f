"""Reading a llama.cpp GGUF file as a HuggingFace model directory, its weights left in place.

A GGUF keeps the weights quantized and in llama.cpp's layout, and the tokenizer as metadata. The
rest of tokenway reads HF directories, so loader.py describes a GGUF once and caches the result:

    tokenizer.ggml.{model,tokens,scores,merges,...} -> tokenizer.json (models/gguf_tokenizer.py)
    {arch}.{block_count,embedding_length,...}       -> config.json, generation_config.json
    blk.{i}.attn_q.weight  GGUF dims (hidden, n_head * head_dim), Q4_K, rows permuted for RoPE
      -> TENSOR_TABLE: model.layers.{i}.self_attn.q_proj.weight (n_head * head_dim, hidden), its
         type, where its bytes lie in the GGUF, and how to read them in HF order

No weight is copied: the loader maps each tensor's bytes from the GGUF when the model loads
(models/weights.py), so the cache holds a few megabytes of JSON, not a float copy of the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tokenway.models import arch as architectures
from tokenway.models.arch import Architecture
from tokenway.models.config import ModelConfig
from tokenway.models.gguf_tokenizer import tokenizer_from_gguf

# Bump whenever the output for the same GGUF changes: it is part of the cache key.
CONVERTER_VERSION = 7
# Where each tensor of the GGUF lies and how to read it (TensorEntry), beside config.json.
TENSOR_TABLE = "gguf-tensors.json"

_GLOBAL_TENSOR_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors whose content becomes config (rope_freqs: Llama 3.1's per-frequency RoPE divisors).
_CONFIG_TENSORS = ("rope_freqs.weight",)


@dataclass(frozen=True, slots=True)
class _TensorPlan:
    source: gguf.ReaderTensor
    hf_name: str
    hf_shape: tuple[int, ...]
    unpermute_num_heads: int | None  # set for llama's q/k, whose rows llama.cpp reordered
    offset: float = 0.0  # subtracted from the values: llama.cpp stores Gemma's norm scales as 1 + w

    def entry(self) -> dict[str, Any]:
        """This tensor's line of TENSOR_TABLE (loader.TensorEntry)."""
        return {"name": self.hf_name, "type": self.source.tensor_type.name, "shape": list(self.hf_shape),
                "offset": int(self.source.data_offset), "nbytes": int(self.source.n_bytes),
                "unpermute_heads": self.unpermute_num_heads, "value_offset": self.offset}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, the tokenizer files and TENSOR_TABLE into out_dir."""
    try:
        reader = gguf.GGUFReader(gguf_path, "r")
    except Exception as exc:  # the reader fails with whatever numpy/struct raised on a bad header
        raise ValueError(f"{gguf_path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from None
    meta = _Metadata(reader, gguf_path)
    hf_config = _hf_config(meta, reader)
    # Reject what the model code cannot run now, not after the slow tensor pass.
    ModelConfig.from_dict(hf_config, source=str(gguf_path))
    tokenizer_fields = {key: meta.get(key) for key in reader.fields
                        if key.startswith("tokenizer.") or key == "general.name"}
    tokenizer, tokenizer_config = tokenizer_from_gguf(tokenizer_fields, str(gguf_path),
                                                      int(meta.require("{arch}.context_length")))
    plans = _tensor_plans(reader, hf_config, meta)

    out_dir.mkdir(parents=True)
    _write_json(out_dir / "config.json", hf_config)
    generation = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"]}
    _write_json(out_dir / "generation_config.json", generation)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    table = {"gguf": str(gguf_path), "tensors": [plan.entry() for plan in plans]}
    _write_json(out_dir / TENSOR_TABLE, table)


class _Metadata:
    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self.path = path
        field = self._fields.get("general.architecture")
        self.arch = "" if field is None else field.contents()
        self.num_experts = int(self.get("{arch}.expert_count", 0) or 0)
        self.family: Architecture = architectures.from_gguf(self.arch, str(path), self.num_experts)

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: missing GGUF metadata key {key.format(arch=self.arch)!r}")
        return value


def _hf_config(meta: _Metadata, reader: gguf.GGUFReader) -> dict[str, Any]:
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{meta.path}: missing tensor 'token_embd.weight'")
    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"{meta.path}: LongRoPE (rope_factors_long.weight, Phi-3 128k) is not supported")
    hidden_size = int(meta.require("{arch}.embedding_length"))
    num_heads = int(meta.require("{arch}.attention.head_count"))
    head_dim = int(meta.get("{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(meta.get("{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"{meta.path}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    family = meta.family
    config: dict[str, Any] = {
        "architectures": [family.name],
        "model_type": family.model_types[0],
        "vocab_size": int(embed.shape[1]),  # GGUF dims are reversed: (hidden, vocab)
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.require("{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require("{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.require("{arch}.context_length")),
        "rms_norm_eps": float(meta.require("{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": _end_of_generation(meta, eos),
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(meta, tensors.get("rope_freqs.weight"), head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if family.experts is not None:
        config.update(_expert_config(meta, tensors, config["intermediate_size"]))
    config.update(family.gguf_fields(meta))
    return config


def _expert_config(meta: _Metadata, tensors: dict[str, gguf.ReaderTensor], intermediate_size: int) -> dict[str, Any]:
    """config.json's mixture-of-experts fields (config._expert_fields reads them back). A layer
    without a router (ffn_gate_inp) is a dense one."""
    num_layers = int(meta.require("{arch}.block_count"))
    return {
        "num_experts": meta.num_experts,
        "num_experts_per_tok": int(meta.require("{arch}.expert_used_count")),
        "moe_intermediate_size": int(meta.get("{arch}.expert_feed_forward_length", intermediate_size)),
        "shared_expert_intermediate_size": int(meta.get("{arch}.expert_shared_feed_forward_length", 0)),
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }

# Tokens llama.cpp ends generation on wherever a vocabulary has them (llama-vocab.cpp's EOG list),
# beside the eos/eot/eom ids the metadata names: a chat model's end of turn (Gemma's
# <end_of_turn>, ChatML's <|im_end|>) is often not its eos.
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"})
# Harmony (gpt-oss) ends a message with <|end|> and the turn with <|return|> or <|call|>: where a
# vocabulary has both, <|end|> is not an end of generation (llama.cpp's rule too).
_HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")


def _end_of_generation(meta: _Metadata, eos: Any) -> int | list[int] | None:
    ids = [int(i) for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
           if i is not None]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids += [i for i, text in enumerate(tokens) if text in _EOG_TEXTS]
    if all(text in tokens for text in _HARMONY_TURN_ENDS):
        ids = [i for i in ids if tokens[i] != "<|end|>"]
    ids = list(dict.fromkeys(ids))  # in order, once each
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _rope_scaling(meta: _Metadata, freqs: gguf.ReaderTensor | None, head_dim: int) -> dict[str, Any] | None:
    if freqs is not None:
        # llama.cpp's converter turns Llama 3.1's llama3 scaling into one divisor per frequency; the
        # parameters it came from are not kept, so the divisors themselves are the scaling.
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if factors.size != head_dim // 2:
            raise ValueError(f"{meta.path}: rope_freqs.weight has {factors.size} factors, expected {head_dim // 2}")
        return {"rope_type": "freq_factors", "factors": factors.tolist()}
    kind = meta.get("{arch}.rope.scaling.type")
    factor = meta.get("{arch}.rope.scaling.factor")
    if kind is None and meta.get("{arch}.rope.scale_linear") is not None:  # pre-2024 files
        kind, factor = "linear", meta.get("{arch}.rope.scale_linear")
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = meta.get("{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.get("{arch}.rope.scaling." + key)
        if value is not None:
            scaling[name] = float(value)
    return scaling


def _tensor_plans(reader: gguf.GGUFReader, hf_config: dict[str, Any], meta: _Metadata) -> list[_TensorPlan]:
    plans = []
    family = meta.family
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        hf_name = _hf_tensor_name(tensor.name, family)
        if hf_name is None:
            raise ValueError(f"{meta.path}: unexpected tensor {tensor.name!r} for architecture {meta.arch!r}")
        hf_shape = tuple(int(d) for d in reversed(tensor.shape))
        if len(hf_shape) == 3 or ".mlp.gate." in hf_name:
            _check_experts(meta, tensor.name, hf_name, hf_shape, hf_config)
        num_heads = None
        # llama.cpp reorders llama's q/k rows (and biases) so its RoPE can rotate adjacent pairs;
        # its other converters leave them alone.
        if family.gguf_permutes_qk and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            is_q = hf_name.split(".")[-2] == "q_proj"
            num_heads = hf_config["num_attention_heads" if is_q else "num_key_value_heads"]
            if hf_shape[0] % (2 * num_heads):
                raise ValueError(
                    f"{meta.path}: {tensor.name} has {hf_shape[0]} rows, not a multiple of 2 * {num_heads} heads"
                )
        offset = family.norm_offset if hf_name.endswith("norm.weight") else 0.0
        plans.append(_TensorPlan(tensor, hf_name, hf_shape, num_heads, offset))
    return plans


def _check_experts(meta: _Metadata, name: str, hf_name: str, shape: tuple[int, ...], hf_config: dict[str, Any]) -> None:
    """An expert tensor or a router whose expert count or shape disagrees with the metadata is
    refused here, at load, not met as a crash mid-request."""
    num_experts = hf_config.get("num_experts", 0)
    hidden = hf_config["hidden_size"]
    inter = hf_config.get("moe_intermediate_size", 0)
    kind = hf_name.split(".")[-2]
    expected = {"gate": (num_experts, hidden), "gate_proj": (num_experts, inter, hidden),
                "up_proj": (num_experts, inter, hidden), "down_proj": (num_experts, hidden, inter)}.get(kind)
    if not num_experts or (expected is not None and hf_name.endswith(".weight") and shape != expected):
        raise ValueError(f"{meta.path}: {name} has shape {list(reversed(shape))} (GGUF order), which does not fit "
                         f"{meta.arch}.expert_count = {num_experts} experts of hidden {hidden}, intermediate "
                         f"{inter} (expected {list(reversed(expected)) if expected else '?'})")


def _hf_tensor_name(name: str, family: Architecture) -> str | None:
    if name in _GLOBAL_TENSOR_TO_HF:
        return _GLOBAL_TENSOR_TO_HF[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in family.gguf_tensors:
        return None
    return f"model.layers.{parts[1]}.{family.gguf_tensors[parts[2]]}.{parts[3]}"


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows (of floats or of whole blocks) in HF order: llama.cpp applied
    w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2); this undoes it."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
