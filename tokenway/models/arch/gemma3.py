"""Gemma 3 (text): interleaved local sliding-window layers and global layers, each kind with its
own RoPE (local: base 10,000, no scaling; global: base 1,000,000 with the config's scaling), QK-norm,
norms before and after both attention and the MLP, GeGLU with tanh, embeddings scaled by
sqrt(hidden_size), and RMSNorm scales stored as (scale - 1). llama.cpp's converter adds the 1 back
(the reader takes it off again) and keeps the layer pattern as metadata or its default of 6."""

from collections.abc import Mapping
from typing import Any

from tokenway.models.arch.base import FULL, LLAMA_GGUF_TENSORS, SLIDING, Architecture
from tokenway.models.rope import Rope

DEFAULT_PATTERN = 6  # every sixth layer global (transformers' sliding_window_pattern, llama.cpp's default)
LOCAL_ROPE_THETA = 10000.0


def layer_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(FULL if pattern and (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _hf_fields(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    query_scale = float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256)
    fields: dict[str, Any] = {"attention_scale": query_scale**-0.5}
    rope_parameters = hf.get("rope_parameters") or {}
    if FULL in rope_parameters:  # transformers >= 5: one set of RoPE parameters per layer kind
        fields["rope"] = Rope.from_hf(rope_parameters[FULL]["rope_theta"], rope_parameters[FULL], "config.json")
        local = rope_parameters.get(SLIDING, {"rope_theta": LOCAL_ROPE_THETA})
        fields["local_rope"] = Rope.from_hf(local["rope_theta"], local, "config.json")
    else:
        fields["local_rope"] = Rope(float(hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)))
    layer_types = hf.get("layer_types") or layer_pattern(
        num_layers, int(hf.get("sliding_window_pattern", DEFAULT_PATTERN)))
    if hf.get("sliding_window") and SLIDING in layer_types:
        fields["sliding_window"] = int(hf["sliding_window"])
        fields["layer_types"] = tuple(layer_types)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key):
            fields[key] = float(hf[key])
    return fields


def _gguf_fields(meta: Any) -> dict[str, Any]:
    num_layers = int(meta.require("{arch}.block_count"))
    hidden, heads = int(meta.require("{arch}.embedding_length")), int(meta.require("{arch}.attention.head_count"))
    head_dim = int(meta.get("{arch}.attention.key_length", hidden // heads))
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 62-layer 27B: 1/sqrt(hidden / heads).
    fields: dict[str, Any] = {"query_pre_attn_scalar": hidden // heads if num_layers == 62 else head_dim,
                              "rope_local_base_freq": float(meta.get("{arch}.rope.freq_base_swa", LOCAL_ROPE_THETA))}
    window = meta.get("{arch}.attention.sliding_window")
    if window:
        pattern = meta.get("{arch}.attention.sliding_window_pattern", DEFAULT_PATTERN)
        if isinstance(pattern, list):  # one flag a layer: true = sliding
            fields["layer_types"] = [SLIDING if flag else FULL for flag in pattern]
        else:  # llama.cpp's rule: layer i slides unless i % pattern == pattern - 1
            fields["layer_types"] = list(layer_pattern(num_layers, int(pattern)))
        fields["sliding_window"] = int(window)
    softcap = meta.get("{arch}.final_logit_softcapping")
    if softcap:
        fields["final_logit_softcapping"] = float(softcap)
    return fields


GEMMA3 = Architecture(
    name="Gemma3ForCausalLM",
    model_types=("gemma3_text", "gemma3"),
    gguf_names=("gemma3",),
    qk_norm=True,
    sandwich_norms=True,
    norm_offset=1.0,
    activation="gelu_tanh",
    scale_embeddings=True,
    hf_fields=_hf_fields,
    gguf_tensors={
        **LLAMA_GGUF_TENSORS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_fields=_gguf_fields,
)
