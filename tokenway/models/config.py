"""The shape of a decoder, read from a HuggingFace config.json (GGUF metadata is first turned
into one: models/gguf.py). What differs by family is declared in models/arch/."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenway.models import arch as architectures
from tokenway.models.arch import FULL, SLIDING, Architecture
from tokenway.models.rope import Rope

# config.json activation names -> the decoder's (arch.base.ACTIVATIONS)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of models.arch.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: Rope  # the rotation of full-attention layers
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Per layer, FULL or SLIDING (HF's "layer_types"); empty: every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer attends to, its own token included
    local_rope: Rope | None = None  # the rotation of sliding layers; None: `rope`
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    # Mixture of experts (arch.experts says how they route): experts a layer, experts a token,
    # each routed expert's and the shared expert's intermediate size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense (Qwen-MoE's mlp_only_layers)
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU (expert_kernels.ExpertSpec)
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, "
                             f"the model has {self.num_hidden_layers}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.arch.experts is not None:
            if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"{self.architecture}: a mixture of experts needs num_experts >= 1 and "
                                 f"1 <= num_experts_per_tok <= num_experts, got {self.num_experts} and "
                                 f"{self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"{self.architecture}: moe_intermediate_size must be >= 1")
            if self.arch.experts.shared_expert and self.shared_expert_intermediate_size < 1:
                raise ValueError(f"{self.architecture}: the shared expert needs shared_expert_intermediate_size >= 1")

    @cached_property
    def arch(self) -> Architecture:
        return architectures.by_name(self.architecture)

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer`'s MLP is a mixture of experts."""
        return self.arch.experts is not None and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """Keys layer `layer` attends to (its own token included), or None: the whole context."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides (Mistral v0.1, Phi-3 4k), else None."""
        sliding = self.layer_types and all(kind == SLIDING for kind in self.layer_types)
        return self.sliding_window if sliding else None

    def rope_of(self, layer: int) -> Rope:
        return self.local_rope if self.local_rope is not None and self.is_sliding(layer) else self.rope

    @classmethod
    def from_dict(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = architectures.from_hf(hf.get("architectures") or [], hf.get("model_type"), source)
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            num_layers = int(hf["num_hidden_layers"])
            eos = hf.get("eos_token_id")
            fields: dict[str, Any] = dict(
                architecture=arch.name,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", arch.attention_bias)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
            )
            _check_activation(hf, arch, source)
            rope_parameters = hf.get("rope_parameters") or {}
            if FULL not in rope_parameters:  # one rotation for every layer (the family may say otherwise)
                _check_rotary(hf, rope_parameters, source)
                # transformers >= 5 folds rope_theta into rope_parameters.
                theta = hf.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
                scaling = hf.get("rope_scaling") or (rope_parameters if rope_parameters.get("rope_type", "default")
                                                     != "default" else None)
                if scaling is not None and hf.get("original_max_position_embeddings"):
                    scaling = {"original_max_position_embeddings": hf["original_max_position_embeddings"], **scaling}
                fields["rope"] = Rope.from_hf(theta, scaling, source)
            if arch.experts is not None:
                fields.update(_expert_fields(hf, num_layers))
            fields.update(arch.hf_fields(hf, num_layers))
            config = cls(**fields)
        except KeyError as exc:
            raise ValueError(f"{source}: missing required field {exc.args[0]!r}") from None
        except TypeError as exc:  # a field of the wrong JSON type
            raise ValueError(f"{source}: {exc}") from None
        if config.final_logit_softcapping is None and hf.get("attn_logit_softcapping"):
            raise ValueError(f"{source}: attention logit soft-capping (attn_logit_softcapping) is not supported")
        return config

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path}: not found; a HuggingFace model directory needs config.json")
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(hf, source=str(path))


def _expert_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields, by the names the MoE families' config.json use."""
    step = int(hf.get("decoder_sparse_step") or 1)
    mlp_only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    return {
        "num_experts": int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step),
    }


def _check_activation(hf: dict[str, Any], arch: Architecture, source: str) -> None:
    name = hf.get("hidden_activation") or hf.get("hidden_act")
    if name is not None and _ACTIVATIONS.get(name) != arch.activation:
        raise ValueError(f"{source}: activation {name!r} is not supported for {arch.name} (it runs {arch.activation})")


def _check_rotary(hf: dict[str, Any], rope_parameters: dict[str, Any], source: str) -> None:
    fraction = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if fraction is not None and float(fraction) != 1.0:
        raise ValueError(f"{source}: partial rotary embeddings (partial_rotary_factor {fraction}) are not supported")
