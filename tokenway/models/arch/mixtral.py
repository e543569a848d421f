"""Mixtral (8x7B, 8x22B): Llama with every MLP a mixture of 8 experts, 2 a token, their weights
the softmax over all 8 renormalised over the chosen two. HF names the block `block_sparse_moe`
and the projections w1 (gate), w3 (up), w2 (down). llama.cpp converts it as "llama" with
experts (and reorders q/k rows as for Llama)."""

from tokenway.models.arch.base import LLAMA_GGUF_TENSORS, MOE_GGUF_TENSORS, Architecture, Experts, uniform_window

MIXTRAL = Architecture(
    name="MixtralForCausalLM",
    model_types=("mixtral",),
    gguf_moe_names=("llama",),
    gguf_permutes_qk=True,
    experts=Experts(renormalize=True),
    hf_fields=uniform_window,
    hf_renames={"block_sparse_moe.": "mlp.", ".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight",
                ".w2.weight": ".down_proj.weight"},
    gguf_tensors={**LLAMA_GGUF_TENSORS, **MOE_GGUF_TENSORS},
)
