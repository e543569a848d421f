"""The shape of a Llama-family decoder, read from a HuggingFace config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF architecture name -> whether q/k/v projections carry a bias by default.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
MODEL_TYPE_TO_ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @classmethod
    def from_dict(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        architectures = hf.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None and not architectures:
            architecture = MODEL_TYPE_TO_ARCHITECTURE.get(hf.get("model_type", ""))
        if architecture is None:
            raise ValueError(
                f"{source}: unsupported architecture {architectures or hf.get('model_type')!r}; "
                f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            rope_scaling = hf.get("rope_scaling") or None
            # transformers >= 5 folds rope_theta into rope_parameters.
            rope_parameters = hf.get("rope_parameters") or {}
            rope_theta = float(hf.get("rope_theta", rope_parameters.get("rope_theta", 10000.0)))
            if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
            eos = hf.get("eos_token_id")
            config = cls(
                architecture=architecture,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", SUPPORTED_ARCHITECTURES[architecture])),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing required field {exc.args[0]!r}") from None
        if config.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{source}: unsupported rope_scaling type {config.rope_type!r}; "
                f"expected one of {SUPPORTED_ROPE_TYPES}"
            )
        return config

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path}: not found; a HuggingFace model directory needs config.json")
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(hf, source=str(path))
