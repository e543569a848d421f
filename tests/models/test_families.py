"""Every supported family end to end: a tiny random model built with transformers' own class,
served by the engine from its safetensors directory and from the GGUF llama.cpp's converter
makes of it: greedy tokens equal transformers' generate, for 8 prompts in one batch (some longer
than the sliding window, so windows slide mid-generation), again on prefix-cache hits.

The converter is llama.cpp's own convert_hf_to_gguf.py, from the llama-cpp-python sdist on PyPI
(fetched into this directory's .llama_cpp/ on first use; the peer benchmarks' unpacked copy is
used when present). Where neither can be had, the GGUF half skips, saying why."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenway.engine.llm import LLM  # noqa: E402
from tokenway.protocol.sampling import SamplingParams  # noqa: E402

WINDOW = 12  # a sliding layer's keys: prompts of up to 40 tokens plus 16 new ones slide past it
VOCAB = 49152  # the default model's tokenizer, copied in (the converter needs a real one)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
SLIDING, FULL = "sliding_attention", "full_attention"


def family_config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)
    if kind == "mistral":  # llama.cpp converts Mistral as "llama": its GGUF keeps no window
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if kind == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    if kind == "gemma3":
        # Five local layers and a global one: the pattern llama.cpp assumes where the GGUF names none.
        return transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=32,
                                             query_pre_attn_scalar=32, sliding_window=WINDOW,
                                             layer_types=[SLIDING] * 5 + [FULL])
    if kind == "phi3":
        return transformers.Phi3Config(**COMMON, pad_token_id=0, sliding_window=WINDOW)
    raise AssertionError(kind)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


def build(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    """Save a tiny random `kind` model with transformers' class and the default model's tokenizer."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(family_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # uneven norms and non-zero biases, so a forgotten one shows
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    if kind == "phi3":  # llama.cpp's Phi-3 converter reads tokenizer.model unless the class says GPT-2
        config = (out / "tokenizer_config.json").read_text().replace('"PreTrainedTokenizerFast"', '"GPT2Tokenizer"')
        (out / "tokenizer_config.json").write_text(config)
    return out


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 9, 12, 13, 20, 27, 33, 40]  # below, at and past the window
    return [torch.randint(100, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model_dir: Path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            generated = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                    min_new_tokens=max_tokens, pad_token_id=0)
            out.append(generated[0, len(ids):].tolist())
    return out


def serve_and_compare(model: str, expected: list[list[int]], cache_dir: Path, max_tokens: int,
                      kv_cache_memory: int = 64 * 2**20, expect_hits: bool = True, **engine_options) -> LLM:
    llm = LLM(model, dtype="float32", block_size=4, kv_cache_memory=kv_cache_memory, max_model_len=128,
              linear_kernels="default", cache_dir=str(cache_dir), show_progress=False, **engine_options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": ids} for ids in prompts()]
    for attempt in ("cold", "prefix-cache hits"):
        outputs = llm.generate(batch, params)
        got = [list(output.outputs[0].token_ids) for output in outputs]
        for index, (ours, theirs) in enumerate(zip(got, expected)):
            assert ours == theirs, f"{attempt}: prompt {index} ({len(batch[index]['prompt_token_ids'])} tokens)"
    assert llm.engine.kv_manager.num_hit_tokens > 0 or not expect_hits
    return llm


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_from_safetensors_and_gguf_generates_as_transformers(kind, tmp_path, tokenizer_dir, converter):
    max_tokens = 16
    model_dir = build(kind, tmp_path / kind, tokenizer_dir)
    expected = transformers_greedy(model_dir, prompts(), max_tokens)
    serve_and_compare(str(model_dir), expected, tmp_path / "cache", max_tokens)

    if kind == "qwen2":
        # transformers loads a qwen2 directory's tokenizer with Qwen2's own pre-tokenizer, which over
        # SmolLM's vocabulary hashes to nothing llama.cpp's converter knows; Qwen3 (converted below)
        # reads GGUF the same way with q/k norms added, and tests/models/test_loader.py covers qwen2's.
        return
    gguf_path = tmp_path / f"{kind}.gguf"
    converted = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", "f32",
                                "--outfile", str(gguf_path)], capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr[-2000:]
    if kind == "mistral":
        # llama.cpp writes Mistral as "llama" and drops its window: the GGUF is the model without one.
        hf_config = transformers.AutoConfig.from_pretrained(model_dir)
        hf_config.sliding_window = None
        hf_config.save_pretrained(model_dir)
        expected = transformers_greedy(model_dir, prompts(), max_tokens)
    serve_and_compare(str(gguf_path), expected, tmp_path / "cache", max_tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "phi3"])
def test_bfloat16_checkpoints_are_computed_as_stored(kind, tmp_path, tokenizer_dir):
    """A bfloat16 checkpoint served in float32: its matmuls and embedding on the file's bfloat16
    rows in place (models/quant_raw.py), never expanded, and transformers' tokens (its float32
    model of the same checkpoint: the same weights). Tied embeddings (llama, qwen3), Gemma's
    scaled embeddings, Phi-3's fused projections."""
    from tokenway.models.quant_raw import RawQuantKernel

    model_dir = build(kind, tmp_path / kind, tokenizer_dir)
    transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(model_dir)
    expected = transformers_greedy(model_dir, prompts(), 16)
    llm = serve_and_compare(str(model_dir), expected, tmp_path / "cache", 16)
    model = llm.engine.model
    kernels = [model.embedding, model.head] + [k for layer in model.decoder_layers
                                               for k in (layer.self_attn.qkv, layer.self_attn.o)]
    for kernel in kernels:
        parts = getattr(kernel, "parts", [kernel])
        assert all(isinstance(p, RawQuantKernel) and p.qtype == "BF16" for p in parts), type(kernel).__name__
    assert model.embed_tokens.numel() == 0  # no float copy of the table


def test_blocks_behind_every_layers_window_go_back_to_the_pool(tmp_path, tokenizer_dir):
    """Mistral with a 12-key window on every layer: each request holds a few blocks, not its whole
    context, so 8 requests (285 tokens, 75 blocks of 4) run at once in a cache of 44 blocks."""
    from tokenway.engine.runner import kv_bytes_per_block
    from tokenway.models.config import ModelConfig

    max_tokens = 16
    model_dir = build("mistral", tmp_path / "mistral", tokenizer_dir)
    expected = transformers_greedy(model_dir, prompts(), max_tokens)
    block_bytes = kv_bytes_per_block(ModelConfig.from_dir(model_dir), 4, torch.float32)
    # (a cache this small evicts the first run's blocks before the second: no hits expected)
    llm = serve_and_compare(str(model_dir), expected, tmp_path / "cache", max_tokens, kv_cache_memory=44 * block_bytes,
                            expect_hits=False)
    assert llm.engine.kv_manager.null_block is not None
    assert llm.engine.scheduler.num_preemptions == 0


def test_mixed_layers_run_more_long_requests_in_the_same_kv_memory(tmp_path, tokenizer_dir):
    """Gemma 3 with five 12-key sliding layers per global one: its sliding layers keep their window
    in blocks of their own, and the rest of the memory goes to the global layer. 8 requests (71
    blocks of 4 at their longest) then run at once in memory that held 64 blocks for every layer."""
    from tokenway.engine.runner import kv_bytes_per_block
    from tokenway.models.config import ModelConfig

    max_tokens = 16
    model_dir = build("gemma3", tmp_path / "gemma3", tokenizer_dir)
    expected = transformers_greedy(model_dir, prompts(), max_tokens)
    block_bytes = kv_bytes_per_block(ModelConfig.from_dir(model_dir), 4, torch.float32)
    assert sum(-(-(len(ids) + max_tokens - 1) // 4) for ids in prompts()) == 71  # the last token has no KV
    llm = serve_and_compare(str(model_dir), expected, tmp_path / "cache", max_tokens, kv_cache_memory=64 * block_bytes,
                            max_num_seqs=8, max_num_batched_tokens=64)
    full, sliding = llm.engine.kv_manager.groups
    # The sliding group holds 8 windows (5 blocks each) and a step's 64 new tokens, plus its null block.
    assert (sliding.window, sliding.block_pool.num_blocks, full.block_pool.num_blocks) == (WINDOW, 57, 99)
    assert llm.engine.scheduler.num_preemptions == 0
    assert full.num_free_blocks == full.num_blocks and sliding.num_free_blocks == sliding.num_blocks

    # Four prompts behind one 10-token prefix: they hit its blocks in both groups and decode
    # reading them once a step (cascade attention), each group from its own tables.
    prefix = torch.randint(100, VOCAB, (10,), generator=torch.Generator().manual_seed(9)).tolist()
    batch = [prefix + [100 + index] for index in range(4)]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert [list(output.outputs[0].token_ids) for output in outputs] == transformers_greedy(model_dir, batch,
                                                                                            max_tokens)
    assert [output.num_cached_tokens for output in outputs] == [0, 8, 8, 8]
