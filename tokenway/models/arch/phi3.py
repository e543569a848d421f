"""Phi-3 (mini, small, medium; 4k windows): Llama with q/k/v fused into one qkv_proj and gate/up
into one gate_up_proj in the checkpoint (the decoder fuses them anyway), and a sliding window on
every layer where config.json sets one. The 128k variants' LongRoPE is refused by the RoPE reader."""

from typing import Any

from tokenway.models.arch.base import LLAMA_GGUF_TENSORS, Architecture, uniform_window


def _gguf_fields(meta: Any) -> dict[str, Any]:
    window = meta.get("{arch}.attention.sliding_window")
    return {"sliding_window": int(window)} if window else {}


PHI3 = Architecture(
    name="Phi3ForCausalLM",
    model_types=("phi3",),
    gguf_names=("phi3",),
    hf_fields=uniform_window,
    gguf_tensors={**{k: v for k, v in LLAMA_GGUF_TENSORS.items()
                     if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")},
                  "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    gguf_fields=_gguf_fields,
)
