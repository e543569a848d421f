"""Rotary position embeddings: the inverse frequencies of each scaling a checkpoint may name,
computed as transformers does (modeling_rope_utils.py), and the cos/sin tables the decoder reads.

A model may rotate different layers differently (Gemma 3: local sliding-window layers at base
10,000, global layers at 1,000,000 with their own scaling): a `Rope` is one such rotation, and
the config names one per layer kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
# "freq_factors" is not a transformers type: it is how a GGUF keeps Llama 3.1's scaling (one divisor
# per frequency, the tensor rope_freqs.weight), written so by models/gguf.py.


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotation: base theta and the scaling applied to it (rope_type plus its parameters)."""

    theta: float
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ... as config.json names them

    @classmethod
    def from_hf(cls, theta: float, scaling: dict[str, Any] | None, source: str) -> Rope:
        scaling = dict(scaling or {})
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default")) or "default"
        scaling.pop("rope_theta", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{source}: unsupported rope scaling type {rope_type!r}; expected one of "
                             f"{list(SUPPORTED_ROPE_TYPES)}")
        if rope_type in ("linear", "llama3") and scaling.get("factor") is None:
            raise ValueError(f"{source}: rope scaling {rope_type!r} needs a 'factor'")
        if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
            raise ValueError(f"{source}: rope scaling 'llama3' needs 'original_max_position_embeddings'")
        if rope_type == "yarn" and scaling.get("factor") is None and "original_max_position_embeddings" not in scaling:
            raise ValueError(f"{source}: rope scaling 'yarn' needs 'factor' or 'original_max_position_embeddings'")
        return cls(float(theta), rope_type, scaling)

    def inv_freq(self, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        """((head_dim/2,) float32 inverse frequencies, the factor cos and sin are multiplied by)."""
        dim = head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        p = self.params
        if self.rope_type == "linear":
            return inv_freq / float(p["factor"]), 1.0
        if self.rope_type == "llama3":
            # Llama 3.1: leave high frequencies, divide low ones by factor, blend in between.
            factor = float(p["factor"])
            low_freq_factor = float(p.get("low_freq_factor", 1.0))
            high_freq_factor = float(p.get("high_freq_factor", 4.0))
            old_context_len = float(p["original_max_position_embeddings"])
            low_freq_wavelen = old_context_len / low_freq_factor
            high_freq_wavelen = old_context_len / high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
            return torch.where(is_medium, smoothed, scaled), 1.0
        if self.rope_type == "yarn":
            return self._yarn(dim, max_position_embeddings)
        if self.rope_type == "freq_factors":  # as ggml's rope_ext divides each frequency's angle
            factors = torch.tensor(p["factors"], dtype=torch.float32)
            if factors.numel() != dim // 2:
                raise ValueError(f"rope freq_factors: {factors.numel()} factors for head_dim {dim}")
            return inv_freq / factors, 1.0
        return inv_freq, 1.0

    def _yarn(self, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        # YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, ramp between,
        # and scale attention by mscale.
        p = self.params
        original = int(p.get("original_max_position_embeddings") or max_position_embeddings)
        factor = float(p["factor"]) if p.get("factor") is not None else max_position_embeddings / original

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
            attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else get_mscale(factor))
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no singular ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention_factor)

    def tables(self, head_dim: int, max_position_embeddings: int,
               num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_positions, head_dim) float32 cos and sin, as HF computes them (fp32 outer product)."""
        inv_freq, attention_factor = self.inv_freq(head_dim, max_position_embeddings)
        positions = torch.arange(num_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor
