"""A decode-only step's decoder layers as one native call (csrc/layers.cpp).

At one token a layer is ~8 operator calls whose kernels run a few microseconds each, so the
Python around them (module calls, argument parsing, dispatch: ~1 ms of a 6-9 ms step for
SmolLM2's 30 layers) is a real share of the step. The stack holds every layer's weights and
KV cache once and makes the same calls, in the same order, from C++: the output is the Python
loop's (LlamaForCausalLM.forward with the fused kernels) bit for bit.

It serves steps where every token is a decode (prompt chunks take the Python loop, whose
prefill attention is torch's) and every layer's matmuls read GGUF blocks (models/quant.py)
with one kind of products (each matmul of any block type the kernel reads, a fused one of
several: a Q4_K_M file's Q6_K v beside Q4_K q and k, as models/decoder.ConcatKernel runs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenway import native
from tokenway.models.attention import AttentionMetadata
from tokenway.models.interjection import Interjection

if TYPE_CHECKING:
    from tokenway.models.decoder import DecoderForCausalLM
    from tokenway.models.quant import QuantKernel


class DecodeStack:
    __slots__ = ("_decode", "_stack", "kernels", "kv_caches", "matmuls", "num_layers")

    def __init__(self, model: DecoderForCausalLM, matmuls: list[list[QuantKernel]],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, ops) -> None:
        """matmuls: every layer's matmuls in call order (qkv, o, gate_up, down), each as the
        kernels of its parts (one, or a ConcatKernel's), all on blocks."""
        config = model.config
        self.kv_caches = kv_caches
        self.num_layers = len(kv_caches)
        self.matmuls = matmuls
        self.kernels = [kernel for parts in matmuls for kernel in parts]
        tensors = [model.rope_cos, model.rope_sin]
        ints = [config.num_attention_heads, config.num_key_value_heads, config.head_dim, block_size]
        empty = torch.empty(0)
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(model.decoder_layers, kv_caches)):
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, k_cache, v_cache]
            for parts in matmuls[4 * index:4 * index + 4]:
                ints.append(len(parts))
                for kernel in parts:
                    bias = kernel.bias_or_none
                    tensors += [kernel.weight, empty if bias is None else bias]
                    ints += [kernel.out_features, kernel.qtype_id]
        scale = model.decoder_layers[0].self_attn.scale
        self._stack = torch.classes.tokenway_layers.Stack(tensors, ints, config.rms_norm_eps, scale,
                                                          self.kernels[0].products)
        self._decode = ops.decode

    @classmethod
    def build(cls, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              block_size: int) -> DecodeStack | None:
        """The stack for these caches, or None when a layer cannot run in it (a float weight,
        mixed products, the fused kernels off) or the native kernels are not built."""
        from tokenway.models.decoder import ConcatKernel
        from tokenway.models.quant import QuantKernel

        layers = model.decoder_layers
        if model.fused is None or len(kv_caches) != len(layers):
            return None
        matmuls: list[list[QuantKernel]] = []
        for layer in layers:
            for kernel in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
                parts = kernel.parts if isinstance(kernel, ConcatKernel) else [kernel]
                on_blocks = [part for part in parts if isinstance(part, QuantKernel)]
                if len(on_blocks) < len(parts):  # a float weight, or blocks through torch operators
                    return None
                matmuls.append(on_blocks)
        if len({kernel.products for parts in matmuls for kernel in parts}) != 1:
            return None
        # The operators the stack calls must be registered before it looks them up.
        if native.load("quant") is None or native.load("attention") is None:
            return None
        ops = native.load("layers")
        return None if ops is None else cls(model, matmuls, kv_caches, block_size, ops)

    def takes(self, num_tokens: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: AttentionMetadata) -> bool:
        """A decode-only step on these caches through the native attention kernel, at a token
        count every matmul runs on its blocks (as the Python loop would)."""
        return (not meta.prefills and meta.decode_kernel is not None and kv_caches is self.kv_caches
                and num_tokens == meta.num_decode_tokens
                and self.kernels[0].reads_blocks(num_tokens))  # one products: one answer

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 interjection: Interjection | None = None) -> torch.Tensor:
        """(T, hidden) float32 embeddings (used as the residual stream, so overwritten) -> (T, hidden)
        hidden states before the final norm. With an interjection, the native loop returns at the
        layer boundary after its wake_fd turns readable; its run() goes, then the loop goes on."""
        args = (x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                meta.decode_prefix_leaders, meta.decode_prefix_lens)
        if interjection is None:
            return self._decode(self._stack, *args)[0]
        h, layer = self._decode(self._stack, *args, None, 0, interjection.wake_fd)
        while layer < self.num_layers:
            interjection.run()
            h, layer = self._decode(self._stack, *args, h, layer, interjection.wake_fd)
        return h
