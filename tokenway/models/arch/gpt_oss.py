"""gpt-oss (20b, 120b): attention with q/k/v/o biases and a learned sink logit per head, layers
alternating between a 128-token sliding window (even layers) and full attention, YaRN RoPE
(not truncated, as OpenAI's reference computes it), and every MLP a mixture of experts: a router
with a bias, the top 4 of 32 (or 128) logits softmaxed among themselves, experts with biases and
a clamped SwiGLU: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7).

HF keeps each layer's experts as two 3-D tensors, gate and up interleaved by column in one
(E, hidden, 2 * intermediate) and down as (E, intermediate, hidden); the decoder's are (E, rows,
in_features), as a GGUF's are. OpenAI's own checkpoints keep the experts in MXFP4 instead
(gate_up_proj_blocks (E, 2 * intermediate, hidden / 32, 16) and _scales, down likewise), rows
already (E, rows, in_features) with gate and up interleaved by row: mapped in place, the gate
and up are every other row of the one tensor (models/weights.py expert_weights).
llama.cpp's converter writes "gpt-oss", its experts split and transposed so, and alternates the
window from layer 0 (set_swa_pattern(2))."""

from collections.abc import Mapping
from typing import Any

from tokenway.models.arch.base import FULL, LLAMA_GGUF_TENSORS, MOE_GGUF_TENSORS, SLIDING, Architecture, Experts
from tokenway.models.expert_kernels import ExpertWeights


def _hf_fields(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
                              "swiglu_limit": float(hf.get("swiglu_limit", 7.0))}
    layer_types = hf.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if hf.get("sliding_window") and SLIDING in layer_types:
        fields["sliding_window"] = int(hf["sliding_window"])
        fields["layer_types"] = tuple(layer_types)
    return fields


def _gguf_fields(meta: Any) -> dict[str, Any]:
    num_layers = int(meta.require("{arch}.block_count"))
    fields: dict[str, Any] = {"intermediate_size": int(meta.require("{arch}.expert_feed_forward_length"))}
    window = meta.get("{arch}.attention.sliding_window")
    if window:
        fields["sliding_window"] = int(window)
        fields["layer_types"] = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    kind = meta.get("{arch}.rope.scaling.type")
    if kind == "yarn":
        fields["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(meta.require("{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(meta.require("{arch}.rope.scaling.original_context_length")),
            "beta_fast": float(meta.get("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    return fields


def _split(name: str, tensor: Any) -> list[tuple[str, Any]]:
    """HF's fused, transposed expert tensors -> the decoder's (E, rows, in_features) ones."""
    if isinstance(tensor, ExpertWeights):  # MXFP4 as stored (weights.expert_weights): (E, rows, in_features)
        if name == "mlp.experts.gate_up_proj":  # (E, 2 * inter, hidden), gate and up interleaved by row
            return [("mlp.experts.gate_proj.weight", tensor.every_other_row(0)),
                    ("mlp.experts.up_proj.weight", tensor.every_other_row(1))]
        if name == "mlp.experts.down_proj":
            return [("mlp.experts.down_proj.weight", tensor)]
        return [(name, tensor)]
    if name == "mlp.experts.gate_up_proj":  # (E, hidden, 2 * inter), gate and up interleaved
        return [("mlp.experts.gate_proj.weight", tensor[..., ::2].transpose(1, 2)),
                ("mlp.experts.up_proj.weight", tensor[..., 1::2].transpose(1, 2))]
    if name == "mlp.experts.gate_up_proj_bias":  # (E, 2 * inter)
        return [("mlp.experts.gate_proj.bias", tensor[..., ::2]), ("mlp.experts.up_proj.bias", tensor[..., 1::2])]
    if name == "mlp.experts.down_proj":  # (E, inter, hidden)
        return [("mlp.experts.down_proj.weight", tensor.transpose(1, 2))]
    if name == "self_attn.sinks":  # a parameter of its own in HF, a weight in a GGUF
        return [("self_attn.sinks.weight", tensor)]
    if name == "mlp.experts.down_proj_bias":
        return [("mlp.experts.down_proj.bias", tensor)]
    if name.endswith(("_blocks", "_scales")):  # weights.expert_weights pairs and maps every such pair
        part, other = ("blocks", "scales") if name.endswith("_blocks") else ("scales", "blocks")
        raise ValueError(f"{name}: MXFP4 {part} without their {other} (or of a shape that is not "
                         f"(experts, rows, blocks, 16) beside (experts, rows, blocks))")
    return [(name, tensor)]


GPT_OSS = Architecture(
    name="GptOssForCausalLM",
    model_types=("gpt_oss",),
    gguf_names=("gpt-oss",),
    attention_bias=True,
    output_bias=True,
    attention_sinks=True,
    experts=Experts(routing="topk_softmax", router_bias=True, expert_bias=True, activation="swiglu_oai"),
    hf_fields=_hf_fields,
    hf_renames={"mlp.router.": "mlp.gate."},
    hf_split=_split,
    gguf_tensors={**LLAMA_GGUF_TENSORS, **MOE_GGUF_TENSORS, "post_attention_norm": "post_attention_layernorm",
                  "attn_sinks": "self_attn.sinks"},
    gguf_fields=_gguf_fields,
)
