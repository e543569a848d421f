"""Llama 1-3.x (and SmolLM, and Mistral converted by llama.cpp, which it writes as "llama"):
the decoder as it is. llama.cpp's converter reorders q/k rows for its RoPE; the reader undoes it."""

from tokenway.models.arch.base import Architecture

LLAMA = Architecture(
    name="LlamaForCausalLM",
    model_types=("llama",),
    gguf_names=("llama",),
    gguf_permutes_qk=True,
)
