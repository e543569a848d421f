"""The decoder every supported family runs (models/arch/ says where each departs from Llama's),
over a paged KV cache.

One forward runs a flat batch of T tokens from many requests: chunks of prompts and
single decode tokens alike. The runner orders it as [decode tokens | prefill tokens]:
the Bd decode requests (one query token each) come first so their attention is one
padded, batched call; each prefill chunk then attends on its own (models/attention.py).
Sliding-window layers read the metadata the runner laid out for their window (meta.sliding).

Activations and the residual stream stay float32; linear weights and the KV cache use
`dtype` (bfloat16 where the CPU has bf16 dot-product instructions; see engine config).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tokenway import native
from tokenway.models.attention import AttentionMetadata, decode_attention, prefill_attention
from tokenway.models.config import ModelConfig
from tokenway.models.decode_stack import DecodeStack
from tokenway.models.expert_kernels import ExpertWeights
from tokenway.models.experts import PROJECTIONS, SparseMoe, per_expert, weight_targets
from tokenway.models.interjection import Interjection
from tokenway.models.linear import LinearKernel
from tokenway.models.quant_raw import RawQuantKernel
from tokenway.models.weights import QuantizedTensor

if TYPE_CHECKING:
    from tokenway.models.quant import QuantKernel
    from tokenway.models.quant_torch import TorchQuantKernel

    # What a matmul runs on: its float weight until use_quantized puts its blocks' kernel in place.
    Matmul: TypeAlias = "LinearKernel | QuantKernel | TorchQuantKernel | RawQuantKernel | ConcatKernel"

GLOBAL, LOCAL = "global", "local"  # which RoPE tables a layer reads (ModelConfig.rope, .local_rope)


_Stored = TypeVar("_Stored", torch.Tensor, ExpertWeights)  # what a checkpoint name may hold


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True, slots=True)
class RopeInputs:
    """What RoPE reads: (max_positions, head_dim) tables and each token's position."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor  # (T,) int64

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, head_dim) cos and sin of each token's position, for the torch path."""
        return self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; bitwise equal to weight * x * rsqrt(mean(x^2) + eps) in float32.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.scale
        self.sliding = config.is_sliding(layer)  # attends through meta.sliding, its window's layout
        self.rope = LOCAL if self.sliding and config.local_rope is not None else GLOBAL
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
        self.o_bias = (nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype), requires_grad=False)
                       if config.arch.output_bias else None)
        self.qkv: Matmul = LinearKernel(self.qkv_weight, self.qkv_bias)
        self.o: Matmul = LinearKernel(self.o_weight, self.o_bias)
        # gpt-oss: each head's learned logit, one more column of every softmax (its value zero).
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
                      if config.arch.attention_sinks else None)
        # QK-norm (Qwen3, Gemma 3): each head of q and k RMS-normed before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.arch.qk_norm else None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(T, q+2kv) float32 q, k, v of x, QK-normed where the family norms them."""
        qkv = self.qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            num_tokens, q, kv = qkv.shape[0], self.q_size, self.kv_size
            heads = (num_tokens, -1, self.head_dim)
            qkv[:, :q] = self.q_norm(qkv[:, :q].reshape(heads)).view(num_tokens, q)
            qkv[:, q:q + kv] = self.k_norm(qkv[:, q:q + kv].reshape(heads)).view(num_tokens, kv)
        return qkv

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        rope: RopeInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x (num_slots, kv_heads, head_dim)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.project(x)
        cos, sin = rope.gathered()
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
        meta = self.layout(meta)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        return self._attend(q, k, v, k_cache, v_cache, meta)

    def forward_fused(self, x: torch.Tensor, rope: RopeInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: AttentionMetadata, ops) -> torch.Tensor:
        """forward with RoPE, the cache writes and the casts in one native call (csrc/fused.cpp)."""
        k_cache, v_cache = kv_cache
        meta = self.layout(meta)
        q = ops.rope_and_cache(self.project(x), rope.cos_table, rope.sin_table, rope.positions, k_cache, v_cache,
                               meta.slot_mapping, self.num_heads, self.num_kv_heads)
        k = v = None
        if meta.prefills:  # prompt chunks read their new keys and values back from where they were just written
            k, v = k_cache.index_select(0, meta.slot_mapping), v_cache.index_select(0, meta.slot_mapping)
        return self._attend(q, k, v, k_cache, v_cache, meta)

    def layout(self, meta: AttentionMetadata) -> AttentionMetadata:
        """This layer's layout of the step: a sliding layer's KV cache group has block ids (so slots) of
        its own where layers mix (engine/runner.py), for its writes as for its reads."""
        if not self.sliding:
            return meta
        assert meta.sliding is not None, "the runner lays out a window for models with sliding layers"
        return meta.sliding

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows through the paged decode attention, prompt chunks (with their new keys and
        values k, v) through prefill attention, then o, in this layer's layout (layout()).
        q, k, v: (T, heads, head_dim) in the cache's dtype."""
        num_tokens = q.shape[0]
        sinks = self.sinks
        if not meta.prefills:
            return self.o(decode_attention(q, k_cache, v_cache, meta, self.scale, sinks).reshape(num_tokens,
                                                                                                 self.q_size))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = decode_attention(q[:num_decodes], k_cache, v_cache, meta, self.scale, sinks)
        assert k is not None and v is not None, "prompt chunks come with their new keys and values"
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, meta.block_size,
                                          self.scale, sinks)
        return self.o(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        """intermediate_size: the config's unless given (a mixture's shared expert has its own)."""
        super().__init__()
        inter = self.intermediate_size = intermediate_size or config.intermediate_size
        self.activation = config.arch.activation
        # gate and up fused: (2 * intermediate, hidden)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * inter, config.hidden_size, dtype=dtype),
                                           requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(config.hidden_size, inter, dtype=dtype), requires_grad=False)
        self.gate_up: Matmul = LinearKernel(self.gate_up_weight)
        self.down: Matmul = LinearKernel(self.down_weight)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if ops is not None and self.activation == "silu":
            return self.down(ops.silu_and_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        if self.activation == "gelu_tanh":
            return self.down(F.gelu(gate, approximate="tanh") * up)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """input_layernorm -> attention -> [attn_out_norm] -> residual add -> post_attention_layernorm
    -> MLP -> [mlp_out_norm] -> residual add. post_attention_layernorm is the MLP's input norm
    (Llama's name for it; Gemma calls it pre_feedforward_layernorm); the bracketed output norms
    are the sandwich families' (Gemma's post_attention_layernorm and post_feedforward_layernorm)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp: MLP | SparseMoe
        if config.is_sparse(layer):
            shared = (MLP(config, dtype, config.shared_expert_intermediate_size)
                      if config.shared_expert_intermediate_size else None)
            self.mlp = SparseMoe(config, dtype, shared)
        else:
            self.mlp = MLP(config, dtype)
        sandwich = config.arch.sandwich_norms
        self.attn_out_norm = RMSNorm(config.hidden_size, eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(config.hidden_size, eps) if sandwich else None

    def forward(self, x, rope: RopeInputs, kv_cache, meta):
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        x = x + (h if self.attn_out_norm is None else self.attn_out_norm(h))
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if self.mlp_out_norm is None else self.mlp_out_norm(h))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, ops):
        """(this layer's output, the residual stream before it): the residual add of the previous
        layer is fused into this layer's input norm (residual += x; x = norm(residual))."""
        if residual is None:
            residual, x = x, ops.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            ops.add_rms_norm_(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        x = self.self_attn.forward_fused(x, rope, kv_cache, meta, ops)
        if self.attn_out_norm is not None:
            x = ops.rms_norm(x, self.attn_out_norm.weight, self.attn_out_norm.eps)
        ops.add_rms_norm_(x, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        x = self.mlp(x, ops)
        if self.mlp_out_norm is not None:
            x = ops.rms_norm(x, self.mlp_out_norm.weight, self.mlp_out_norm.eps)
        return x, residual


class ConcatKernel:
    """y = x @ cat(W_1, ..., W_n).T for weights stored in different block types: each part's kernel
    writes its columns of one output (no copy)."""

    __slots__ = ("parts", "columns", "out_features", "in_features")

    def __init__(self, parts: list[QuantKernel | TorchQuantKernel | RawQuantKernel]) -> None:
        self.parts = parts
        self.columns: list[slice] = []  # of the output, each part's
        start = 0
        for part in parts:
            assert part.out_features is not None  # a built kernel knows its rows
            self.columns.append(slice(start, start + part.out_features))
            start += part.out_features
        self.out_features = start
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, device=x.device)
        for part, columns in zip(self.parts, self.columns):
            part(x, out=out[:, columns])
        return out


class DecoderForCausalLM(nn.Module):
    # Buffers (register_buffer), which nn.Module's attribute lookup types as Tensor | Module.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    local_rope_cos: torch.Tensor
    local_rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None) -> None:
        """max_positions: the longest context served (the RoPE tables' length); the config's
        max_position_embeddings when None."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        arch = config.arch
        # The embedding is a lookup, not a matmul: keep it float32 for the residual stream.
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        # Lookups from the GGUF's blocks instead (use_quantized).
        self.embedding: QuantKernel | TorchQuantKernel | RawQuantKernel | None = None
        # Gemma multiplies embeddings by sqrt(hidden_size), rounded to the embedding's dtype.
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size)) if arch.scale_embeddings else None
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                    requires_grad=False)
        self.head: Matmul = LinearKernel(self.lm_head)
        self._quantized_params: set[str] = set()  # weights whose matmul runs on quantized blocks
        self.fused = None  # csrc/fused.cpp's operators once use_fused_kernels() found them
        self.decode_stack: DecodeStack | None = None  # decode-only steps in one native call (use_decode_stack)
        # (positions, head_dim) cos/sin tables, computed as HF does (fp32 outer product).
        num_positions = min(config.max_position_embeddings, max_positions or config.max_position_embeddings)
        cos, sin = config.rope.tables(config.head_dim, config.max_position_embeddings, num_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.local_rope is not None:
            cos, sin = config.local_rope.tables(config.head_dim, config.max_position_embeddings, num_positions)
            self.register_buffer("local_rope_cos", cos, persistent=False)
            self.register_buffer("local_rope_sin", sin, persistent=False)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        # nn.ModuleList types its items as nn.Module; every one of these is a DecoderLayer.
        return cast("Sequence[DecoderLayer]", self.layers)

    @property
    def plain_layers(self) -> bool:
        """Every layer is one the native decode stack runs: Llama's (one RoPE table, no sandwich
        norms, silu) with, where the family has them, QK-norm (Qwen3), sliding windows (each
        layer in its own layout), attention sinks and an output bias (gpt-oss), and a mixture of
        experts for its MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss)."""
        arch = self.config.arch
        return not arch.sandwich_norms and arch.activation == "silu" and self.config.local_rope is None

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        interjection: Interjection | None = None,
    ) -> torch.Tensor:
        """interjection: work to let run between two layers (models/interjection.py)."""
        if self.embedding is not None:
            x = self.embedding.embedding(input_ids)  # (T, hidden) float32, decoded from its blocks
        else:
            x = self.embed_tokens.index_select(0, input_ids)  # (T, hidden)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        if self.decode_stack is not None and self.decode_stack.takes(x.shape[0], kv_caches, meta):
            return self.decode_stack(x, positions, meta, interjection)
        ropes = {GLOBAL: RopeInputs(self.rope_cos, self.rope_sin, positions)}
        if self.config.local_rope is not None:
            ropes[LOCAL] = RopeInputs(self.local_rope_cos, self.local_rope_sin, positions)
        between = None if interjection is None else interjection.run
        if self.fused is not None:
            residual = None
            for index, (layer, kv_cache) in enumerate(zip(self.decoder_layers, kv_caches)):
                if index and between is not None:
                    between()
                x, residual = layer.forward_fused(x, residual, ropes[layer.self_attn.rope], kv_cache, meta, self.fused)
            assert residual is not None  # a model has layers
            return x + residual
        for index, (layer, kv_cache) in enumerate(zip(self.decoder_layers, kv_caches)):
            if index and between is not None:
                between()
            x = layer(x, ropes[layer.self_attn.rope], kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32; the final norm runs only on the N rows that sample."""
        if self.fused is not None:
            logits = self.head(self.fused.rms_norm(hidden, self.norm.weight, self.norm.eps))
        else:
            logits = self.head(self.norm(hidden))
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def use_fused_kernels(self) -> bool:
        """Run RoPE + cache writes, residual add + norm and silu * up as native fused operators
        (csrc/fused.cpp) when they build and the model is float32 activations on the CPU."""
        on_cpu = self.rope_cos.device.type == "cpu" and self.norm.weight.dtype == torch.float32
        self.fused = native.load("fused") if on_cpu and self.config.head_dim % 2 == 0 else None
        return self.fused is not None

    def use_decode_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> bool:
        """Run decode-only steps on these caches as one native call (models/decode_stack.py) when
        every layer can; after use_fused_kernels and use_quantized, with the caches the runner keeps."""
        self.decode_stack = DecodeStack.build(self, kv_caches, block_size) if self.plain_layers else None
        return self.decode_stack is not None

    def _matmuls(self) -> list[tuple[str, nn.Module, str]]:
        """(weight parameter name, module, kernel attribute) of every matmul."""
        out: list[tuple[str, nn.Module, str]] = [("lm_head", self, "head")]
        for index, layer in enumerate(self.decoder_layers):
            prefix = f"layers.{index}"
            out += [(f"{prefix}.self_attn.qkv_weight", layer.self_attn, "qkv"),
                    (f"{prefix}.self_attn.o_weight", layer.self_attn, "o")]
            # A mixture's experts are not matmuls of their own (experts.py); its shared expert is one.
            mlp, mlp_prefix = layer.mlp, f"{prefix}.mlp"
            if isinstance(mlp, SparseMoe):
                if mlp.shared is None:
                    continue
                mlp, mlp_prefix = mlp.shared, f"{prefix}.mlp.shared"
            out += [(f"{mlp_prefix}.gate_up_weight", mlp, "gate_up"), (f"{mlp_prefix}.down_weight", mlp, "down")]
        return out

    def linear_kernels(self) -> list[LinearKernel]:
        """Every matmul still on a float weight, for models/linear.select_kernels (after loading)."""
        kernels = (getattr(module, attr) for _, module, attr in self._matmuls())
        return [kernel for kernel in kernels if isinstance(kernel, LinearKernel)]

    def quant_kernels(self) -> list[QuantKernel | TorchQuantKernel | RawQuantKernel]:
        """Every matmul on GGUF blocks (models/quant.py), a ConcatKernel's parts each."""
        kernels = (getattr(module, attr) for _, module, attr in self._matmuls())
        out: list[QuantKernel | TorchQuantKernel | RawQuantKernel] = []
        for kernel in kernels:
            if isinstance(kernel, ConcatKernel):
                out += kernel.parts
            elif not isinstance(kernel, LinearKernel):
                out.append(kernel)
        return out

    @property
    def num_quantized_matmuls(self) -> int:
        return len(self._quantized_params - {"embed_tokens"})

    def use_quantized(self, tensors: dict[str, QuantizedTensor], activations: str = "dtype",
                      relaid: dict[str, torch.Tensor] | None = None,
                      torch_device: torch.device | None = None) -> set[str]:
        """Run the matmuls whose weights are stored in blocks models/quant.py reads on those
        blocks, and look token embeddings up from theirs: q/k/v and gate/up are one kernel where
        their parts share a type, else one kernel a part writing into one output (a Q4_K_M file's
        Q6_K v beside Q4_K q and k). Their float parameters are released. Returns the HF names
        used, which load_weights then skips. activations: "int8" or "dtype" (quant.products_for).
        relaid: kernels' weights relaid by an earlier start (relaid_weights()), by parameter name.
        torch_device: run the blocks through torch operators on this device instead (quant_torch.py:
        a GPU, where the native kernels do not run)."""
        from tokenway.models import dequant, quant_raw
        from tokenway.models.quant import QuantKernel
        from tokenway.models.quant import supports as native_supports
        from tokenway.models.quant_torch import TorchQuantKernel

        relaid = relaid or {}
        config = self.config
        used: set[str] = set()
        on_torch = torch_device is not None

        def supports(qtype: str, in_features: int) -> bool:
            if on_torch:
                return qtype in dequant.QTYPES
            return native_supports(qtype, in_features) or on_raw_blocks(qtype, in_features)

        def on_raw_blocks(qtype: str, in_features: int) -> bool:
            """A type the relaid kernel does not read (Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4), on the
            file's blocks in place (models/quant_raw.py)."""
            return (not native_supports(qtype, in_features) and quant_raw.supports(qtype, in_features)
                    and quant_raw.available())

        def kernel_for(name: str, parts: list[QuantizedTensor],
                       bias: torch.Tensor | None) -> QuantKernel | TorchQuantKernel | RawQuantKernel | ConcatKernel:
            qtypes = {t.qtype for t in parts}
            if torch_device is None and len(parts) == 1 and on_raw_blocks(parts[0].qtype, parts[0].shape[1]):
                return RawQuantKernel(parts[0].blocks, parts[0].qtype, parts[0].shape[1], bias)
            if torch_device is not None and len(qtypes) == 1:  # rows of blocks concatenate as they are
                blocks = torch.cat([t.blocks for t in parts]) if len(parts) > 1 else parts[0].blocks
                return TorchQuantKernel(blocks, parts[0].qtype, parts[0].shape[1], bias, self.dtype, torch_device)
            one_kernel = not any(on_raw_blocks(t.qtype, t.shape[1]) for t in parts)
            if one_kernel and len(qtypes) == 1 and (len(parts) == 1 or
                                                    all(t.shape[0] % QuantKernel.ROWS == 0 for t in parts)):
                # One kernel: relaid parts whose rows fill whole lane groups concatenate as relaid whole.
                weight = relaid.get(name)
                if weight is None:
                    weight = torch.cat([QuantKernel.relayout(t) for t in parts]) if len(parts) > 1 else None
                return QuantKernel(parts[0].blocks if weight is None else None, parts[0].qtype, parts[0].shape[1],
                                   bias=bias, dtype=self.dtype, activations=activations, relaid=weight,
                                   out_features=sum(t.shape[0] for t in parts))
            kernels: list[QuantKernel | TorchQuantKernel | RawQuantKernel] = []
            start = 0
            for index, part in enumerate(parts):
                rows = slice(start, start + part.shape[0])
                kernel = kernel_for(f"{name}.{index}", [part], None if bias is None else bias[rows])
                assert not isinstance(kernel, ConcatKernel)  # one part: one kernel
                kernels.append(kernel)
                start += part.shape[0]
            return ConcatKernel(kernels)

        # Each fused matmul's checkpoint parts: separate projections, or one already fused (Phi-3).
        parts = {"qkv": [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",)],
                 "o": [("self_attn.o_proj",)], "gate_up": [("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",)],
                 "down": [("mlp.down_proj",)]}
        embedding = tensors.get("model.embed_tokens.weight")
        if embedding is not None and supports(embedding.qtype, embedding.shape[1]):
            # Lookups decode their rows from the blocks: no float copy of the table (Gemma's is 670 MB).
            kernel = kernel_for("embed_tokens", [embedding], None)
            assert not isinstance(kernel, ConcatKernel)  # one part: one kernel
            self.embedding = kernel
            self.embed_tokens.data = torch.empty(0)
            self._quantized_params.add("embed_tokens")
            used.add("model.embed_tokens.weight")
        matmuls = tqdm(self._matmuls(), desc="Preparing GGUF blocks", unit="matmul", disable=None if tensors else True)
        for param_name, module, attr in matmuls:
            if attr == "head":
                names = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
            else:
                index = param_name.split(".")[1]
                options = parts[attr]
                if ".mlp.shared." in param_name:  # a mixture's shared expert, by the checkpoint's name
                    options = [tuple(p.replace("mlp.", "mlp.shared_expert.") for p in option) for option in options]
                candidates = [[f"model.layers.{index}.{part}.weight" for part in option] for option in options]
                names = next((option for option in candidates if option[0] in tensors), candidates[0])
            found = [t for name in names if (t := tensors.get(name)) is not None]
            if len(found) < len(names) or not all(supports(t.qtype, t.shape[1]) for t in found):
                continue
            kernel = getattr(module, attr)
            if attr == "head" and config.tie_word_embeddings and self.embedding is not None:
                quantized = self.embedding  # one relaid table for the lookup and the head
            else:
                quantized = kernel_for(param_name, found, kernel.bias)
            setattr(module, attr, quantized)
            kernel.weight.data = torch.empty(0, dtype=kernel.weight.dtype)
            self._quantized_params.add(param_name)
            if attr != "head" or not config.tie_word_embeddings:
                used.update(names)
        return used

    def use_experts(self, tensors: dict[str, ExpertWeights]) -> set[str]:
        """Run each mixture's experts on the file's tensors as stored (mapped in place, in any type
        the expert kernels read: never expanded to float), named as the file names them (the
        family's renames and splits apply, as to any weight). Returns the file's names used, which
        load_weights then skips."""
        from tokenway.models.expert_kernels import STORED_QTYPES

        named: dict[str, tuple[ExpertWeights, str]] = {}  # the decoder's name -> (experts, the file's name)
        for source, weights in tensors.items():
            for name, part in self._family_names([(source, weights)]):
                named[name] = (part, source)
        used: set[str] = set()
        for index, layer in enumerate(self.decoder_layers):
            if not isinstance(layer.mlp, SparseMoe):
                continue
            names = [f"model.layers.{index}.mlp.experts.{proj}_proj.weight" for proj in PROJECTIONS]
            found = [named.get(name) for name in names]
            stored = [t for t in found if t is not None]
            if len(stored) < len(names):
                continue
            for name, (weights, _) in zip(names, stored):
                if weights.qtype not in STORED_QTYPES:  # every type the kernels read, torch's included
                    raise ValueError(f"{name}: experts stored as {weights.qtype}, a type tokenway cannot "
                                     f"compute on (it reads {', '.join(STORED_QTYPES)})")
            layer.mlp.use_stored(*(weights for weights, _ in stored))
            self._quantized_params.update(f"layers.{index}.mlp.{proj}_weight" for proj in PROJECTIONS)
            used.update(source for _, source in stored)
        return used

    def relaid_weights(self) -> dict[str, torch.Tensor]:
        """Every block kernel's relaid weight, by the name use_quantized(relaid=) takes it back under."""
        out: dict[str, torch.Tensor] = {}
        kernels = [("embed_tokens", self.embedding)] + [(name, getattr(module, attr))
                                                        for name, module, attr in self._matmuls()]
        seen: set[int] = set()  # a tied head is the embedding's kernel: kept once
        for name, kernel in kernels:
            if kernel is None or isinstance(kernel, LinearKernel) or id(kernel) in seen:
                continue
            seen.add(id(kernel))
            # Kernels on the file's blocks as stored (quant_raw.py) map the GGUF: nothing to keep.
            if isinstance(kernel, ConcatKernel):
                out.update((f"{name}.{index}", part.weight) for index, part in enumerate(kernel.parts)
                           if not isinstance(part, RawQuantKernel))
            elif not isinstance(kernel, RawQuantKernel):
                out[name] = kernel.weight
        return out

    _QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")

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
            "self_attn.qkv_proj.weight": ("self_attn.qkv_weight", 0, q_size + 2 * kv_size),
            "mlp.gate_proj.weight": ("mlp.gate_up_weight", 0, inter),
            "mlp.up_proj.weight": ("mlp.gate_up_weight", inter, inter),
            "mlp.gate_up_proj.weight": ("mlp.gate_up_weight", 0, 2 * inter),
            "self_attn.o_proj.weight": ("self_attn.o_weight", 0, hidden),
            "self_attn.o_proj.bias": ("self_attn.o_bias", 0, hidden),
            "self_attn.sinks.weight": ("self_attn.sinks", 0, config.num_attention_heads),
            "mlp.down_proj.weight": ("mlp.down_weight", 0, hidden),
            "input_layernorm.weight": ("input_layernorm.weight", 0, hidden),
            "post_attention_layernorm.weight": ("post_attention_layernorm.weight", 0, hidden),
            "self_attn.q_norm.weight": ("self_attn.q_norm.weight", 0, config.head_dim),
            "self_attn.k_norm.weight": ("self_attn.k_norm.weight", 0, config.head_dim),
        }
        if config.arch.sandwich_norms:  # Gemma's names: see DecoderLayer
            fused.update({
                "post_attention_layernorm.weight": ("attn_out_norm.weight", 0, hidden),
                "pre_feedforward_layernorm.weight": ("post_attention_layernorm.weight", 0, hidden),
                "post_feedforward_layernorm.weight": ("mlp_out_norm.weight", 0, hidden),
            })
        norm_offset = config.arch.norm_offset
        experts = weight_targets(config) if config.arch.experts is not None else {}
        params = dict(self.named_parameters())
        # target -> {row offset: rows}; a tied lm_head may arrive twice, which is fine.
        filled: dict[str, dict[int, int]] = {}
        for name, tensor in self._family_names(weights):
            if name == "model.embed_tokens.weight":
                vocab = config.vocab_size
                targets = [("embed_tokens", 0, vocab)] + ([("lm_head", 0, vocab)] if config.tie_word_embeddings else [])
            elif name == "lm_head.weight":
                targets = [("lm_head", 0, config.vocab_size)]
            elif name == "model.norm.weight":
                targets = [("norm.weight", 0, hidden)]
            elif name.startswith("model.layers."):
                _, _, index, suffix = name.split(".", 3)
                one_expert = per_expert(suffix, tensor) if experts else None
                if one_expert is not None:  # one expert's projection: one row of the stacked parameter
                    target, expert, tensor = one_expert
                    targets = [(f"layers.{index}.{target}", expert, 1)]
                elif suffix in experts and config.is_sparse(int(index)):
                    target, offset, rows = experts[suffix]
                    targets = [(f"layers.{index}.{target}", offset, rows)]
                elif suffix not in fused or (suffix in self._QK_NORMS and not config.arch.qk_norm):
                    if "rotary_emb" in suffix:
                        continue
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                else:
                    target, offset, rows = fused[suffix]
                    targets = [(f"layers.{index}.{target}", offset, rows)]
            else:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            if norm_offset and name.endswith("norm.weight"):
                tensor = tensor.float() + norm_offset  # as the family's RMSNorm computes (1 + w), in float32
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
        for layer in self.decoder_layers:
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.finish()

    def place_experts(self, torch_device: torch.device) -> None:
        """After the model moved to torch_device (a GPU): the experts' kernels with their blocks there."""
        for layer in self.decoder_layers:
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.finish(torch_device)

    def _family_names(self, weights: Iterable[tuple[str, _Stored]]) -> Iterator[tuple[str, _Stored]]:
        """A checkpoint's layer tensors (or experts as stored) under the decoder's names and
        layouts, where the family spells them its own way (arch.hf_renames, arch.hf_split)."""
        arch = self.config.arch
        for name, tensor in weights:
            if not name.startswith("model.layers.") or not (arch.hf_renames or arch.hf_split):
                yield name, tensor
                continue
            _, _, index, suffix = name.split(".", 3)
            for old, new in arch.hf_renames.items():
                suffix = suffix.replace(old, new)
            parts = arch.hf_split(suffix, tensor) if arch.hf_split is not None else [(suffix, tensor)]
            for part, part_tensor in parts:
                yield f"model.layers.{index}.{part}", part_tensor
