"""Mistral: Llama with a sliding attention window on every layer when config.json sets one
(v0.1: 4,096; v0.2 and later: none). llama.cpp converts it as "llama"."""

from tokenway.models.arch.base import Architecture, uniform_window

MISTRAL = Architecture(
    name="MistralForCausalLM",
    model_types=("mistral",),
    hf_fields=uniform_window,
)
