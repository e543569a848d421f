"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

One forward runs a flat batch of T tokens from many requests: chunks of prompts and
single decode tokens alike. The runner orders it as [decode tokens | prefill tokens]:
the Bd decode requests (one query token each) come first so their attention is one
padded, batched call; each prefill chunk then attends on its own (models/attention.py).

Activations and the residual stream stay float32; linear weights and the KV cache use
`dtype` (bfloat16 where the CPU has bf16 dot-product instructions; see engine config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenway import native
from tokenway.models.attention import AttentionMetadata, decode_attention, prefill_attention
from tokenway.models.config import ModelConfig
from tokenway.models.decode_stack import DecodeStack
from tokenway.models.linear import LinearKernel
from tokenway.models.loader import QuantizedTensor

if TYPE_CHECKING:
    from tokenway.models.quant import QuantKernel


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with the config's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif config.rope_type == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by factor, blend in between.
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True, slots=True)
class RopeInputs:
    """What the fused RoPE reads: the model's (max_positions, head_dim) tables and each token's position."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor  # (T,) int64


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; bitwise equal to weight * x * rsqrt(mean(x^2) + eps) in float32.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # q, k and v projections fused: one matmul instead of three. (q+2kv, hidden)
        self.qkv_weight = nn.Parameter(
            torch.empty(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype), requires_grad=False)
            if config.attention_bias
            else None
        )
        self.o_weight = nn.Parameter(torch.empty(config.hidden_size, self.q_size, dtype=dtype), requires_grad=False)
        self.qkv = LinearKernel(self.qkv_weight, self.qkv_bias)
        self.o = LinearKernel(self.o_weight)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,  # (T, 1, head_dim)
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x (num_slots, kv_heads, head_dim)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv(x)
        # RoPE on q and k in one go: (T, heads + kv_heads, head_dim), in float32 as HF does.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = qk * cos + rotate_half(qk) * sin
        k_cache, v_cache = kv_cache
        cache_dtype = k_cache.dtype
        # Attention runs in the cache's dtype, so fresh and cached keys are the same numbers.
        qk = qk.to(cache_dtype)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].reshape(num_tokens, self.num_kv_heads, self.head_dim).to(cache_dtype)
        # Every token's K/V is written before anyone reads: a request may attend to blocks
        # another request in this same step is filling (a prefix-cache hit).
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        return self._attend(q, k, v, k_cache, v_cache, meta)

    def forward_fused(self, x: torch.Tensor, rope: RopeInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: AttentionMetadata, ops) -> torch.Tensor:
        """forward with RoPE, the cache writes and the casts in one native call (csrc/fused.cpp)."""
        k_cache, v_cache = kv_cache
        q = ops.rope_and_cache(self.qkv(x), rope.cos_table, rope.sin_table, rope.positions, k_cache, v_cache,
                               meta.slot_mapping, self.num_heads, self.num_kv_heads)
        k = v = None
        if meta.prefills:  # prompt chunks read their new keys and values back from where they were just written
            k, v = k_cache.index_select(0, meta.slot_mapping), v_cache.index_select(0, meta.slot_mapping)
        return self._attend(q, k, v, k_cache, v_cache, meta)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows through the paged decode attention, prompt chunks (with their new keys and
        values k, v) through prefill attention, then o. q, k, v: (T, heads, head_dim) in the cache's dtype."""
        num_tokens = q.shape[0]
        if not meta.prefills:
            return self.o(decode_attention(q, k_cache, v_cache, meta, self.scale).reshape(num_tokens, self.q_size))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = decode_attention(q[:num_decodes], k_cache, v_cache, meta, self.scale)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, meta.block_size,
                                          self.scale)
        return self.o(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up fused: (2 * intermediate, hidden)
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * config.intermediate_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.down_weight = nn.Parameter(
            torch.empty(config.hidden_size, config.intermediate_size, dtype=dtype), requires_grad=False
        )
        self.gate_up = LinearKernel(self.gate_up_weight)
        self.down = LinearKernel(self.down_weight)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if ops is not None:
            return self.down(ops.silu_and_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, ops):
        """(this layer's output, the residual stream before it): the residual add of the previous
        layer is fused into this layer's input norm (residual += x; x = norm(residual))."""
        if residual is None:
            residual, x = x, ops.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            ops.add_rms_norm_(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        x = self.self_attn.forward_fused(x, rope, kv_cache, meta, ops)
        ops.add_rms_norm_(x, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp(x, ops), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # The embedding is a lookup, not a matmul: keep it float32 for the residual stream.
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.head = LinearKernel(self.lm_head)
        self._quantized_params: set[str] = set()  # weights whose matmul runs on quantized blocks
        self.fused = None  # csrc/fused.cpp's operators once use_fused_kernels() found them
        self.decode_stack: DecodeStack | None = None  # decode-only steps in one native call (use_decode_stack)
        # (max_positions, head_dim) cos/sin tables, computed as HF does (fp32 outer product).
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(positions, rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens.index_select(0, input_ids)  # (T, hidden)
        if self.decode_stack is not None and self.decode_stack.takes(x.shape[0], kv_caches, meta):
            return self.decode_stack(x, positions, meta)
        if self.fused is not None:
            rope = RopeInputs(self.rope_cos, self.rope_sin, positions)
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer.forward_fused(x, residual, rope, kv_cache, meta, self.fused)
            return x + residual
        cos = self.rope_cos[positions].unsqueeze(1)  # (T, 1, head_dim)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32; the final norm runs only on the N rows that sample."""
        if self.fused is not None:
            return self.head(self.fused.rms_norm(hidden, self.norm.weight, self.norm.eps))
        return self.head(self.norm(hidden))

    def use_fused_kernels(self) -> bool:
        """Run RoPE + cache writes, residual add + norm and silu * up as native fused operators
        (csrc/fused.cpp) when they build and the model is float32 activations on the CPU."""
        on_cpu = self.rope_cos.device.type == "cpu" and self.norm.weight.dtype == torch.float32
        self.fused = native.load("fused") if on_cpu and self.config.head_dim % 2 == 0 else None
        return self.fused is not None

    def use_decode_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> bool:
        """Run decode-only steps on these caches as one native call (models/decode_stack.py) when
        every layer can; after use_fused_kernels and use_quantized, with the caches the runner keeps."""
        self.decode_stack = DecodeStack.build(self, kv_caches, block_size)
        return self.decode_stack is not None

    def _matmuls(self) -> list[tuple[str, nn.Module, str]]:
        """(weight parameter name, module, kernel attribute) of every matmul."""
        out = [("lm_head", self, "head")]
        for index, layer in enumerate(self.layers):
            prefix = f"layers.{index}"
            out += [(f"{prefix}.self_attn.qkv_weight", layer.self_attn, "qkv"),
                    (f"{prefix}.self_attn.o_weight", layer.self_attn, "o"),
                    (f"{prefix}.mlp.gate_up_weight", layer.mlp, "gate_up"),
                    (f"{prefix}.mlp.down_weight", layer.mlp, "down")]
        return out

    def linear_kernels(self) -> list[LinearKernel]:
        """Every matmul still on a float weight, for models/linear.select_kernels (after loading)."""
        kernels = (getattr(module, attr) for _, module, attr in self._matmuls())
        return [kernel for kernel in kernels if isinstance(kernel, LinearKernel)]

    def quant_kernels(self) -> list[QuantKernel]:
        """Every matmul on GGUF blocks (models/quant.py)."""
        kernels = (getattr(module, attr) for _, module, attr in self._matmuls())
        return [kernel for kernel in kernels if not isinstance(kernel, LinearKernel)]

    @property
    def num_quantized_matmuls(self) -> int:
        return len(self._quantized_params)

    def use_quantized(self, tensors: dict[str, QuantizedTensor], activations: str = "dtype") -> set[str]:
        """Run the matmuls whose weights are stored in blocks models/quant.py reads on those
        blocks: q/k/v and gate/up fuse when all their parts share one type. Their float
        parameters are released. Returns the HF names used, which load_weights then skips.
        activations: "int8" or "dtype" (quant.products_for)."""
        from tokenway.models.quant import QuantKernel, supports

        config = self.config
        used: set[str] = set()
        parts = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                 "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
        for param_name, module, attr in self._matmuls():
            if attr == "head":
                names = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
            else:
                index = param_name.split(".")[1]
                names = [f"model.layers.{index}.{part}.weight" for part in parts[attr]]
            found = [tensors.get(name) for name in names]
            if (any(t is None for t in found) or len({t.qtype for t in found}) != 1
                    or not supports(found[0].qtype, found[0].shape[1])):
                continue
            kernel = getattr(module, attr)
            blocks = torch.cat([t.blocks for t in found]) if len(found) > 1 else found[0].blocks
            setattr(module, attr, QuantKernel(blocks, found[0].qtype, found[0].shape[1], bias=kernel.bias,
                                                dtype=self.dtype, activations=activations))
            kernel.weight.data = torch.empty(0, dtype=kernel.weight.dtype)
            self._quantized_params.add(param_name)
            if attr != "head":  # the tied embedding is still read as floats for the lookup
                used.update(names)
        return used

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be filled."""
        config = self.config
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        hidden = config.hidden_size
        # HF name suffix -> (our parameter suffix, row offset into the fused tensor, rows)
        fused = {
            "self_attn.q_proj.weight": ("self_attn.qkv_weight", 0, q_size),
            "self_attn.k_proj.weight": ("self_attn.qkv_weight", q_size, kv_size),
            "self_attn.v_proj.weight": ("self_attn.qkv_weight", q_size + kv_size, kv_size),
            "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0, q_size),
            "self_attn.k_proj.bias": ("self_attn.qkv_bias", q_size, kv_size),
            "self_attn.v_proj.bias": ("self_attn.qkv_bias", q_size + kv_size, kv_size),
            "mlp.gate_proj.weight": ("mlp.gate_up_weight", 0, inter),
            "mlp.up_proj.weight": ("mlp.gate_up_weight", inter, inter),
            "self_attn.o_proj.weight": ("self_attn.o_weight", 0, hidden),
            "mlp.down_proj.weight": ("mlp.down_weight", 0, hidden),
            "input_layernorm.weight": ("input_layernorm.weight", 0, hidden),
            "post_attention_layernorm.weight": ("post_attention_layernorm.weight", 0, hidden),
        }
        params = dict(self.named_parameters())
        # target -> {row offset: rows}; a tied lm_head may arrive twice, which is fine.
        filled: dict[str, dict[int, int]] = {}
        for name, tensor in weights:
            if name == "model.embed_tokens.weight":
                vocab = config.vocab_size
                targets = [("embed_tokens", 0, vocab)] + ([("lm_head", 0, vocab)] if config.tie_word_embeddings else [])
            elif name == "lm_head.weight":
                targets = [("lm_head", 0, config.vocab_size)]
            elif name == "model.norm.weight":
                targets = [("norm.weight", 0, hidden)]
            elif name.startswith("model.layers."):
                _, _, index, suffix = name.split(".", 3)
                if suffix not in fused:
                    if "rotary_emb" in suffix:
                        continue
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                target, offset, rows = fused[suffix]
                targets = [(f"layers.{index}.{target}", offset, rows)]
            else:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            for target, offset, rows in targets:
                if target in self._quantized_params:
                    continue
                param = params[target]
                if tensor.shape[0] != rows or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit {target} "
                        f"rows {offset}:{offset + rows} of shape {tuple(param.shape)}"
                    )
                param.data[offset : offset + rows].copy_(tensor)
                filled.setdefault(target, {})[offset] = rows
        missing = [n for n, p in params.items()
                   if n not in self._quantized_params and sum(filled.get(n, {}).values()) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
