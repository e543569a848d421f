"""What a decoder family does differently from Llama's, declared as data.

The decoder (models/decoder.py) is Llama's: embeddings, then layers of RMSNorm -> attention with
RoPE over a paged KV cache -> residual -> RMSNorm -> gated MLP -> residual, then a final norm and
the head. An `Architecture` says where a family departs from that, and each family is one small
file in this package that builds one. Reading a checkpoint is the other half: which config.json
fields mean what (`hf_fields`) and which GGUF tensors and metadata keys (`gguf_*`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

FULL = "full_attention"  # HF's names for the layer kinds (config.json "layer_types")
SLIDING = "sliding_attention"
ACTIVATIONS = ("silu", "gelu_tanh")

# GGUF per-layer tensor kinds (blk.N.<kind>.weight) -> HF module names, as llama.cpp's converter writes Llama.
LLAMA_GGUF_TENSORS = MappingProxyType({
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})


def _no_fields(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {}


def _no_gguf_fields(meta: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # the HF class in config.json "architectures", e.g. "Qwen3ForCausalLM"
    model_types: tuple[str, ...]  # config.json "model_type" values that mean this family
    gguf_names: tuple[str, ...] = ()  # GGUF "general.architecture" values
    attention_bias: bool = False  # q/k/v carry a bias when config.json does not say
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each residual add (Gemma)
    norm_offset: float = 0.0  # HF checkpoints store RMSNorm scales as (scale - offset): Gemma's 1 + w
    activation: str = "silu"  # the MLP gate's: silu(gate) * up, or gelu_tanh(gate) * up
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # ModelConfig fields this family reads from config.json beyond the common ones
    # (layer_types, sliding_window, local_rope, attention_scale, softcaps): (hf dict, num layers) -> fields.
    hf_fields: Callable[[Mapping[str, Any], int], dict[str, Any]] = _no_fields
    # GGUF: per-layer tensor kinds -> HF module names, and whether llama.cpp reordered q/k rows.
    gguf_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_TENSORS)
    gguf_permutes_qk: bool = False
    # config.json fields this family's GGUF metadata holds beyond the common ones: (metadata) -> fields.
    gguf_fields: Callable[[Any], dict[str, Any]] = _no_gguf_fields

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{self.name}: activation must be one of {ACTIVATIONS}")


def uniform_window(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Mistral's and Phi-3's rule: a `sliding_window` in config.json applies to every layer."""
    window = hf.get("sliding_window")
    if not window:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(hf.get("layer_types") or (SLIDING,) * num_layers)}
