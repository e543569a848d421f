"""Qwen2 and Qwen2.5: Llama with q/k/v biases. A sliding window only where use_sliding_window
is set, and then for layers from max_window_layers on (config.json's layer_types, when present, says)."""

from collections.abc import Mapping
from typing import Any

from tokenway.models.arch.base import FULL, SLIDING, Architecture


def qwen_window(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    layer_types = hf.get("layer_types")
    if not layer_types:
        if not (hf.get("use_sliding_window") and hf.get("sliding_window")):
            return {}
        first = int(hf.get("max_window_layers", num_layers))
        layer_types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    if SLIDING not in layer_types:
        return {}
    return {"sliding_window": int(hf["sliding_window"]), "layer_types": tuple(layer_types)}


QWEN2 = Architecture(
    name="Qwen2ForCausalLM",
    model_types=("qwen2",),
    gguf_names=("qwen2",),
    attention_bias=True,
    hf_fields=qwen_window,
)
