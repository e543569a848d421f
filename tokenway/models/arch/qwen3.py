"""Qwen3 (dense): Qwen2 without the q/k/v biases, with an RMSNorm over each head of q and k
before RoPE (q_norm, k_norm), and head_dim set apart from hidden_size / heads."""

from tokenway.models.arch.base import LLAMA_GGUF_TENSORS, Architecture
from tokenway.models.arch.qwen2 import qwen_window

QWEN3 = Architecture(
    name="Qwen3ForCausalLM",
    model_types=("qwen3",),
    gguf_names=("qwen3",),
    qk_norm=True,
    hf_fields=qwen_window,
    gguf_tensors={**LLAMA_GGUF_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
)
