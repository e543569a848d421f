"""A decode-only step's decoder layers as one native call (csrc/layers.cpp).

At one token a layer is ~8 operator calls whose kernels run a few microseconds each, so the
Python around them (module calls, argument parsing, dispatch: ~1 ms of a 6-9 ms step for
SmolLM2's 30 layers) is a real share of the step. The stack holds every layer's weights and
KV cache once and makes the same calls, in the same order, from C++: the output is the Python
loop's (LlamaForCausalLM.forward with the fused kernels) bit for bit.

A layer's MLP may be a mixture of experts (models/experts.py SparseMoe): the stack runs its
router, top-k and softmax as route() does (the same ATen operators), then csrc/experts.cpp's op
with the arguments NativeExpertKernel passes, and the shared expert where the family has one;
QK-norm (Qwen3) as Attention.project does. Sliding-window layers (gpt-oss's every other layer,
Mistral's all) write and read their own layout (AttentionMetadata.sliding: slots, tables,
window) as Attention.layout picks it, with gpt-oss's attention sinks and output bias.

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
    from tokenway.models.experts import SparseMoe
    from tokenway.models.quant import QuantKernel


class DecodeStack:
    __slots__ = ("_decode", "_stack", "kernels", "kv_caches", "matmuls", "num_layers", "sliding")

    def __init__(self, model: DecoderForCausalLM, matmuls: list[list[list[QuantKernel]]],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, ops) -> None:
        """matmuls: per layer its matmuls in call order (qkv, o, then gate_up, down of the dense
        MLP or of a mixture's shared expert, none for a mixture without one), each as the kernels
        of its parts (one, or a ConcatKernel's), all on blocks."""
        from tokenway.models.experts import SparseMoe

        config = model.config
        self.kv_caches = kv_caches
        self.num_layers = len(kv_caches)
        self.matmuls = [parts for layer in matmuls for parts in layer]
        self.kernels = [kernel for parts in self.matmuls for kernel in parts]
        self.sliding = any(layer.self_attn.sliding for layer in model.decoder_layers)  # reads meta.sliding
        tensors = [model.rope_cos, model.rope_sin]
        ints = [config.num_attention_heads, config.num_key_value_heads, config.head_dim, block_size]
        floats = [config.rms_norm_eps, model.decoder_layers[0].self_attn.scale]
        empty = torch.empty(0)

        def add_matmul(parts: list[QuantKernel]) -> None:
            ints.append(len(parts))
            for kernel in parts:
                bias = kernel.bias_or_none
                tensors.extend([kernel.weight, empty if bias is None else bias])
                ints.extend([kernel.out_features, kernel.qtype_id])

        for layer, layer_matmuls, (k_cache, v_cache) in zip(model.decoder_layers, matmuls, kv_caches):
            attn = layer.self_attn
            q_norm = empty if attn.q_norm is None else attn.q_norm.weight
            k_norm = empty if attn.k_norm is None else attn.k_norm.weight
            sinks = empty if attn.sinks is None else attn.sinks  # float32 (build checked), as decode_attention
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, k_cache, v_cache,
                        q_norm, k_norm, sinks]
            ints.append(int(attn.sliding))
            add_matmul(layer_matmuls[0])
            add_matmul(layer_matmuls[1])
            mlp = layer.mlp
            if isinstance(mlp, SparseMoe):
                tensors += _mixture_tensors(mlp, empty)
                ints += [1, *_mixture_ints(mlp)]
                floats += _mixture_floats(mlp)
            else:
                ints.append(0)
            for parts in layer_matmuls[2:]:
                add_matmul(parts)
        self._stack = torch.classes.tokenway_layers.Stack(tensors, ints, floats, self.kernels[0].products)
        self._decode = ops.decode

    @classmethod
    def build(cls, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              block_size: int) -> DecodeStack | None:
        """The stack for these caches, or None when a layer cannot run in it (a float weight,
        mixed products, experts off the native kernel, the fused kernels off) or the native
        kernels are not built."""
        from tokenway.models.decoder import ConcatKernel
        from tokenway.models.experts import SparseMoe
        from tokenway.models.quant import QuantKernel

        layers = model.decoder_layers
        if model.fused is None or len(kv_caches) != len(layers):
            return None
        matmuls: list[list[list[QuantKernel]]] = []
        mixture = False
        for layer in layers:
            sinks = layer.self_attn.sinks
            if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
                return None  # decode_attention would pass a float32 copy
            mlp = layer.mlp
            if isinstance(mlp, SparseMoe):
                if not _native_experts(mlp):
                    return None
                mixture = True
                dense = mlp.shared
            else:
                dense = mlp
            kernels = [layer.self_attn.qkv, layer.self_attn.o]
            if dense is not None:
                if dense.activation != "silu":
                    return None
                kernels += [dense.gate_up, dense.down]
            layer_matmuls: list[list[QuantKernel]] = []
            for kernel in kernels:
                parts = kernel.parts if isinstance(kernel, ConcatKernel) else [kernel]
                on_blocks = [part for part in parts if isinstance(part, QuantKernel)]
                if len(on_blocks) < len(parts):  # a float weight, or blocks through torch operators
                    return None
                layer_matmuls.append(on_blocks)
            matmuls.append(layer_matmuls)
        if len({kernel.products for layer in matmuls for parts in layer for kernel in parts}) != 1:
            return None
        # The operators the stack calls must be registered before it looks them up.
        if native.load("quant") is None or native.load("attention") is None:
            return None
        if mixture and native.load("experts") is None:
            return None
        ops = native.load("layers")
        return None if ops is None else cls(model, matmuls, kv_caches, block_size, ops)

    def takes(self, num_tokens: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: AttentionMetadata) -> bool:
        """A decode-only step on these caches through the native attention kernel, at a token
        count every matmul runs on its blocks (as the Python loop would)."""
        sliding = meta.sliding
        return (not meta.prefills and meta.decode_kernel is not None and kv_caches is self.kv_caches
                and num_tokens == meta.num_decode_tokens
                and (not self.sliding or (sliding is not None and sliding.decode_kernel is not None
                                          and not sliding.prefills))
                and self.kernels[0].reads_blocks(num_tokens))  # one products: one answer

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 interjection: Interjection | None = None) -> torch.Tensor:
        """(T, hidden) float32 embeddings (used as the residual stream, so overwritten) -> (T, hidden)
        hidden states before the final norm. With an interjection, the native loop returns at the
        layer boundary after its wake_fd turns readable; its run() goes, then the loop goes on."""
        args = (x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                meta.decode_prefix_leaders, meta.decode_prefix_lens)
        # Each layout's window, and the sliding layers' own layout (Attention.layout), after the loop's state.
        layouts: tuple = (meta.window or 0,)
        sliding = meta.sliding
        if self.sliding and sliding is not None:
            layouts += (sliding.slot_mapping, sliding.decode_block_tables, sliding.decode_context_lens,
                        sliding.decode_prefix_leaders, sliding.decode_prefix_lens, sliding.window or 0)
        wake_fd = -1 if interjection is None else interjection.wake_fd
        h, layer = self._decode(self._stack, *args, None, 0, wake_fd, *layouts)
        while layer < self.num_layers:
            assert interjection is not None  # the loop stops early only when woken
            interjection.run()
            h, layer = self._decode(self._stack, *args, h, layer, wake_fd, *layouts)
        return h


def _native_experts(mlp: SparseMoe) -> bool:
    """Whether the mixture's experts run on csrc/experts.cpp's op as this process builds it (the
    library the stack looks the op up in), its router and shared gate float32 as route() reads them."""
    from tokenway.models.expert_kernels import NativeExpertKernel

    kernel = mlp.kernel
    # The op the kernel calls is the one the stack looks up: the same library, the same activation id.
    return (isinstance(kernel, NativeExpertKernel) and kernel.ops is native.load("experts")
            and isinstance(kernel.activation_id, int)
            and mlp.router_weight.dtype == torch.float32
            and (mlp.shared_gate_weight is None or mlp.shared_gate_weight.dtype == torch.float32))


def _mixture_tensors(mlp: SparseMoe, empty: torch.Tensor) -> list[torch.Tensor]:
    """router_weight, router_bias, the experts' gate, up, down blocks and biases, shared_gate, and
    the experts' scales (split-scale types), as csrc/layers.cpp reads them (empty: none) and
    NativeExpertKernel passes them."""
    from tokenway.models.expert_kernels import NativeExpertKernel

    kernel = mlp.kernel
    assert isinstance(kernel, NativeExpertKernel)  # build() checked
    optional = [mlp.router_bias, kernel.gate_bias, kernel.up_bias, kernel.down_bias, mlp.shared_gate_weight,
                kernel.gate.scales, kernel.up.scales, kernel.down.scales]
    router_bias, gate_bias, up_bias, down_bias, shared_gate, *scales = (empty if t is None else t for t in optional)
    return [mlp.router_weight, router_bias, kernel.gate.blocks, kernel.up.blocks, kernel.down.blocks,
            gate_bias, up_bias, down_bias, shared_gate, *scales]


def _mixture_ints(mlp: SparseMoe) -> list[int]:
    """routing (0 softmax then top-k, 1 top-k then softmax), normalize, top_k, num_experts,
    intermediate, the experts' qtype ids and activation id (expert_kernels' ids)."""
    from tokenway.models.expert_kernels import NATIVE_QTYPE_IDS, NativeExpertKernel

    kernel = mlp.kernel
    assert isinstance(kernel, NativeExpertKernel)
    num_experts, inter, _ = kernel.gate.shape
    return [int(mlp.routing == "topk_softmax"), int(bool(mlp.normalize)), mlp.top_k, num_experts, inter,
            NATIVE_QTYPE_IDS[kernel.gate.qtype], NATIVE_QTYPE_IDS[kernel.up.qtype],
            NATIVE_QTYPE_IDS[kernel.down.qtype], kernel.activation_id]


def _mixture_floats(mlp: SparseMoe) -> list[float]:
    """The experts' alpha and limit (swiglu_oai), as NativeExpertKernel passes them."""
    from tokenway.models.expert_kernels import NativeExpertKernel

    kernel = mlp.kernel
    assert isinstance(kernel, NativeExpertKernel)
    return [kernel.spec.alpha, kernel.spec.limit]
