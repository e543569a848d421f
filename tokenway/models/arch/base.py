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


# GGUF tensor kinds of a mixture-of-experts layer (llama.cpp's names) -> tokenway's HF names. The
# experts of a layer are one 3-D tensor a projection, (experts, rows, in_features), named as one.
MOE_GGUF_TENSORS = MappingProxyType({
    "ffn_gate_inp": "mlp.gate",  # the router: (experts, hidden)
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
})
ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True, slots=True)
class Experts:
    """How a family's mixture-of-experts layers route and compute (models/experts.py runs them).

    routing: "softmax_topk": softmax over every expert's logit, then the k largest (renormalised
    to sum to 1 where the config's norm_topk_prob says, or always with `renormalize`);
    "topk_softmax": the k largest logits, then a softmax over those alone (gpt-oss)."""

    routing: str = "softmax_topk"
    renormalize: bool = False  # the top-k weights always sum to 1 (Mixtral), whatever the config says
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    expert_bias: bool = False  # each expert's gate, up and down have biases (gpt-oss)
    activation: str = "silu"  # models/expert_kernels.ACTIVATIONS: "silu" or gpt-oss's "swiglu_oai"
    shared_expert: bool = False  # a dense expert every token runs, scaled by sigmoid(its gate) (Qwen2-MoE)

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"expert routing must be one of {ROUTINGS}, got {self.routing!r}")


def _no_fields(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {}


def _no_gguf_fields(meta: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # the HF class in config.json "architectures", e.g. "Qwen3ForCausalLM"
    model_types: tuple[str, ...]  # config.json "model_type" values that mean this family
    gguf_names: tuple[str, ...] = ()  # GGUF "general.architecture" values
    # GGUF architectures that mean this family when the file has experts (Mixtral is "llama" with experts).
    gguf_moe_names: tuple[str, ...] = ()
    attention_bias: bool = False  # q/k/v carry a bias when config.json does not say
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each residual add (Gemma)
    norm_offset: float = 0.0  # HF checkpoints store RMSNorm scales as (scale - offset): Gemma's 1 + w
    activation: str = "silu"  # the MLP gate's: silu(gate) * up, or gelu_tanh(gate) * up
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    output_bias: bool = False  # the attention output projection has a bias (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head joins each softmax, its value zero (gpt-oss)
    experts: Experts | None = None  # mixture-of-experts layers: how they route (None: dense MLPs)
    # HF checkpoint names this family spells its own way -> the decoder's (Mixtral's w1/w2/w3).
    hf_renames: Mapping[str, str] = field(default_factory=dict)
    # A checkpoint tensor laid out the family's own way -> the decoder's names and layout:
    # (name after "model.layers.N.", tensor) -> [(name, tensor), ...]; None: every tensor as it is.
    hf_split: Callable[[str, Any], list[tuple[str, Any]]] | None = None
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
