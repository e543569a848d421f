"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a mixture of
experts beside one shared expert every token runs, scaled by sigmoid(its own one-row gate). The
top-k weights are renormalised only where norm_topk_prob says. Qwen3.5-MoE's FFN is this block."""

from typing import Any

from tokenway.models.arch.base import LLAMA_GGUF_TENSORS, MOE_GGUF_TENSORS, Architecture, Experts
from tokenway.models.arch.qwen2 import qwen_window


def _gguf_fields(meta: Any) -> dict[str, Any]:
    return {"norm_topk_prob": bool(meta.get("{arch}.expert_weights_norm", False))}


QWEN2_MOE = Architecture(
    name="Qwen2MoeForCausalLM",
    model_types=("qwen2_moe",),
    gguf_names=("qwen2moe",),
    attention_bias=True,
    experts=Experts(shared_expert=True),
    hf_fields=qwen_window,
    gguf_tensors={**LLAMA_GGUF_TENSORS, **MOE_GGUF_TENSORS,
                  "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                  "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                  "ffn_up_shexp": "mlp.shared_expert.up_proj",
                  "ffn_down_shexp": "mlp.shared_expert.down_proj"},
    gguf_fields=_gguf_fields,
)
