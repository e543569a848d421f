"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's attention (QK-norm, no
biases) with every MLP a mixture of experts: 128 experts, 8 a token, softmax over all of them and
the top 8 renormalised (norm_topk_prob; llama.cpp always renormalises this family's)."""

from typing import Any

from tokenway.models.arch.base import LLAMA_GGUF_TENSORS, MOE_GGUF_TENSORS, Architecture, Experts
from tokenway.models.arch.qwen2 import qwen_window


def _gguf_fields(meta: Any) -> dict[str, Any]:
    return {"norm_topk_prob": bool(meta.get("{arch}.expert_weights_norm", True))}


QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM",
    model_types=("qwen3_moe",),
    gguf_names=("qwen3moe",),
    qk_norm=True,
    experts=Experts(),
    hf_fields=qwen_window,
    gguf_tensors={**LLAMA_GGUF_TENSORS, **MOE_GGUF_TENSORS,
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    gguf_fields=_gguf_fields,
)
