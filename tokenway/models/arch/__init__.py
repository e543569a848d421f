"""The decoder families tokenway runs, by the names checkpoints give them.

Adding one is a file here that builds an `Architecture` (arch/base.py) and a line below."""

from __future__ import annotations

from tokenway.models.arch.base import FULL, SLIDING, Architecture
from tokenway.models.arch.gemma3 import GEMMA3
from tokenway.models.arch.gpt_oss import GPT_OSS
from tokenway.models.arch.llama import LLAMA
from tokenway.models.arch.mistral import MISTRAL
from tokenway.models.arch.mixtral import MIXTRAL
from tokenway.models.arch.phi3 import PHI3
from tokenway.models.arch.qwen2 import QWEN2
from tokenway.models.arch.qwen2_moe import QWEN2_MOE
from tokenway.models.arch.qwen3 import QWEN3
from tokenway.models.arch.qwen3_moe import QWEN3_MOE

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, PHI3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, GPT_OSS)}
_BY_MODEL_TYPE = {model_type: arch for arch in ARCHITECTURES.values() for model_type in arch.model_types}
_BY_GGUF_NAME = {name: arch for arch in ARCHITECTURES.values() for name in arch.gguf_names}
_BY_GGUF_MOE_NAME = {name: arch for arch in ARCHITECTURES.values() for name in arch.gguf_moe_names}

__all__ = ["ARCHITECTURES", "FULL", "SLIDING", "Architecture", "by_name", "from_gguf", "from_hf", "gguf_names"]


def by_name(name: str) -> Architecture:
    return ARCHITECTURES[name]


def from_hf(architectures: list[str], model_type: str | None, source: str) -> Architecture:
    """The family config.json names (its "architectures", else its "model_type")."""
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not architectures and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(f"{source}: unsupported architecture {architectures or model_type!r}; "
                     f"expected one of {sorted(ARCHITECTURES)}")


def from_gguf(name: str, source: str, num_experts: int = 0) -> Architecture:
    """The family a GGUF's general.architecture names; num_experts: its {arch}.expert_count (a
    file of experts may name a dense family's architecture: Mixtral is "llama")."""
    if num_experts and name in _BY_GGUF_MOE_NAME:
        return _BY_GGUF_MOE_NAME[name]
    family = _BY_GGUF_NAME.get(name)
    if family is None or (num_experts and family.experts is None):
        kind = f" (a mixture of {num_experts} experts)" if num_experts else ""
        raise ValueError(f"{source}: unsupported GGUF architecture {name!r}{kind}; expected one of {gguf_names()}")
    return family


def gguf_names() -> list[str]:
    """Every GGUF architecture tokenway reads; "llama" with experts is Mixtral."""
    return sorted(_BY_GGUF_NAME)
