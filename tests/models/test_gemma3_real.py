"""The real Gemma 3 270M Q4_K_M GGUF: tokenway computes what llama.cpp computes on it.

tests/fixtures/gemma3_reference.json holds llama.cpp's greedy 32-token continuations of 20 prompts
(the same prompt ids on both sides) and llama-perplexity's PPL on a ~2,700-token text
(tests/fixtures/make_gemma3_reference.py made it). Both engines quantise differently on the way
(llama.cpp's dot products take Q8_K / Q8_0 activations; tokenway's take the model dtype's, or int8
under bfloat16), so greedy paths agree until a near-tie flips, not bit for bit: the test holds the
agreement to floors and prints what it measured.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from tokenway.engine.llm import LLM
from tokenway.engine.runner import ModelRunner
from tokenway.models.attention import AttentionMetadata, PrefillChunk
from tokenway.protocol.sampling import SamplingParams

REFERENCE = Path(__file__).parents[1] / "fixtures" / "gemma3_reference.json"
BLOCK_SIZE = 16

# Free-running greedy paths of a 4-bit model part once two candidates lie within the engines'
# rounding of each other, and from then on differ wholesale. llama.cpp is no steadier against
# itself: the same server fed the prompt one token at a time (-ub 1) instead of in one batch kept
# 52% of positions before the first divergence and 65% of tokens equal against this fixture.
# Measured for tokenway: float32 64% / 67%, default (bfloat16, int8 activations) 57% / 63%. The
# first token inherits no drift: every prompt must agree on it.
# name: (first tokens equal, share of positions before the first divergence, share of tokens equal)
FREE_RUNNING_FLOORS = {"float32": (1.0, 0.50, 0.55), "default": (1.0, 0.50, 0.55)}
# Given llama.cpp's own prefix, tokenway's argmax was llama.cpp's token at 620/640 (float32) and
# 616-618/640 (default) positions, and where not, llama.cpp's token was at most 0.21 / 0.28-0.45
# nats less likely than tokenway's pick: near-ties. The default's int8 activations are rounded per
# block of 32 where llama.cpp's K-quant dot products round them per 256 (Q8_K), so its near-ties
# move further. A wrong kernel, BOS or window moves logits by nats, at many positions.
TEACHER_FORCED_FLOOR = 0.94
MAX_NEAR_TIE_GAP = 1.0  # nats
# Measured: tokenway 25.37 (float32) and 25.41 (default) against llama-perplexity's 25.57. llama.cpp
# moves by as much between its own kernel paths on this text: 25.53 with --no-repack, 25.66 with
# flash attention off (a float32 KV cache changes nothing). Its dot products round activations to
# 8 bits (Q8_K / Q8_0), which tokenway's float32 path does not.
PPL_TOLERANCE = 0.01  # relative, against llama-perplexity's own PPL on the same chunks


@pytest.fixture(scope="module")
def reference(gemma3_gguf) -> dict:
    reference = json.loads(REFERENCE.read_text())
    with open(gemma3_gguf, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == reference["gguf_sha256"], "not the fixture's GGUF"
    return reference


@pytest.fixture(scope="module", params=["float32", "default"])
def gemma3_llm(request, gemma3_gguf) -> tuple[str, LLM]:
    options = {"dtype": "float32"} if request.param == "float32" else {}
    return request.param, LLM(str(gemma3_gguf), max_model_len=4096, kv_cache_memory="256MiB", show_progress=False,
                              **options)


@pytest.fixture(scope="module")
def runner(gemma3_llm) -> ModelRunner:
    """The engine's model with KV tensors of its own (one 512-token chunk), not the engine's, whose
    blocks the prefix cache may hold; runs whole prompts through chunk_logits."""
    _, llm = gemma3_llm
    return ModelRunner(llm.engine.runner.model, num_blocks=512 // BLOCK_SIZE, block_size=BLOCK_SIZE,
                       device=torch.device("cpu"))


def test_greedy_continuations_match_llama_cpp(gemma3_llm, reference):
    name, llm = gemma3_llm
    cases = reference["cases"]
    num_new = reference["num_new_tokens"]
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": case["prompt_token_ids"]} for case in cases], params)

    first_equal = agreed_prefix = equal = 0
    for case, output in zip(cases, outputs):
        ours, theirs = list(output.outputs[0].token_ids), case["completion_token_ids"]
        assert len(ours) == len(theirs) == num_new
        prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), num_new)
        first_equal += ours[0] == theirs[0]
        agreed_prefix += prefix
        equal += sum(a == b for a, b in zip(ours, theirs))
        print(f"{name}: {prefix:2d}/{num_new} before divergence  {case['prompt'][:40]!r}")
    total = num_new * len(cases)
    shares = (first_equal / len(cases), agreed_prefix / total, equal / total)
    print(f"{name}: first token {shares[0]:.1%}, before first divergence {shares[1]:.1%}, "
          f"equal overall {shares[2]:.1%}")
    floors = FREE_RUNNING_FLOORS[name]
    assert shares[0] >= floors[0], f"{name}: first tokens agree on {shares[0]:.1%} of prompts"
    assert shares[1] >= floors[1], f"{name}: {shares[1]:.1%} of positions before the first divergence"
    assert shares[2] >= floors[2], f"{name}: {shares[2]:.1%} of tokens equal"


def test_tokenizes_the_perplexity_text_as_llama_cpp(gemma3_llm, reference):
    _, llm = gemma3_llm
    perplexity = reference["perplexity"]
    assert llm.tokenizer.encode(perplexity["text"]) == perplexity["text_token_ids"]


def test_teacher_forced_argmax_matches_llama_cpp(gemma3_llm, runner, reference):
    """Given llama.cpp's own prefix at each of the 640 positions, tokenway's argmax is llama.cpp's
    token, or a near-tie with it: this is free of the drift that makes free-running paths part."""
    name, _ = gemma3_llm
    agree, gaps = 0, []
    for case in reference["cases"]:
        prompt_ids, completion_ids = case["prompt_token_ids"], case["completion_token_ids"]
        logits = chunk_logits(runner, prompt_ids + completion_ids, len(prompt_ids) - 1)  # (32, vocab)
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        theirs = torch.tensor(completion_ids)
        ours = log_probs.argmax(dim=-1)
        agree += (ours == theirs).sum().item()
        # how much likelier tokenway finds its own pick than llama.cpp's, where they differ
        gap = log_probs.max(dim=-1).values - log_probs.gather(1, theirs.unsqueeze(1)).squeeze(1)
        gaps.extend(gap[ours != theirs].tolist())
    total = len(reference["cases"]) * reference["num_new_tokens"]
    print(f"{name}: argmax equal at {agree}/{total} positions; "
          f"where not, log-prob gaps {sorted(round(g, 3) for g in gaps)}")
    assert agree / total >= TEACHER_FORCED_FLOOR, f"{name}: argmax equal at {agree}/{total} positions"
    assert max(gaps, default=0.0) <= MAX_NEAR_TIE_GAP, f"{name}: llama.cpp's token {max(gaps):.3f} nats below ours"


def test_perplexity_matches_llama_perplexity(gemma3_llm, runner, reference):
    name, _ = gemma3_llm
    if name != "default":
        # 50 s on 2 cores; float32 is held to llama.cpp position by position above (it measured 25.37).
        pytest.skip("the PPL check runs on the default dtype, the one `tokenway serve` runs")
    perplexity = reference["perplexity"]
    n_ctx, token_ids = perplexity["n_ctx"], perplexity["text_token_ids"]
    assert n_ctx <= runner.kv_caches[0][0].shape[0]
    bos = token_ids[0]
    first = n_ctx // 2
    nll, count = 0.0, 0
    # llama-perplexity's chunking (tools/perplexity/perplexity.cpp): chunk i is ids[i*n_ctx:(i+1)*n_ctx]
    # with its first id made BOS, run from an empty cache; logits at positions first..n_ctx-2 score the next id.
    for start in range(0, len(token_ids) // n_ctx * n_ctx, n_ctx):
        chunk = [bos] + token_ids[start + 1: start + n_ctx]
        logits = chunk_logits(runner, chunk, first)  # (n_ctx - 1 - first, vocab)
        targets = torch.tensor(chunk[first + 1:])
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        nll -= log_probs.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
    assert count == perplexity["num_chunks"] * (n_ctx - 1 - first)
    ours, theirs = math.exp(nll / count), perplexity["ppl"]
    print(f"{name}: PPL {ours:.4f}, llama-perplexity {theirs:.4f} ({ours / theirs - 1:+.2%}) over {count} tokens")
    assert abs(ours / theirs - 1) <= PPL_TOLERANCE


@torch.inference_mode()
def chunk_logits(runner: ModelRunner, chunk: list[int], first: int) -> torch.Tensor:
    """(len(chunk) - 1 - first, vocab) float32: the logits of positions first..len-2 after one
    causal pass over the chunk, laid out as runner.execute lays out a whole fresh prompt (it
    returns the last position's logits only)."""
    num_tokens = len(chunk)
    slots = torch.arange(num_tokens)  # blocks 0, 1, ... in order
    meta = AttentionMetadata(slot_mapping=slots, block_size=BLOCK_SIZE,
                             prefills=[PrefillChunk(0, num_tokens, num_tokens, None, None)])
    if (window := runner.sliding_window) is not None:
        mask = None  # a prompt no longer than the window: its sliding layers see it all, causally
        if num_tokens > window:
            positions = torch.arange(num_tokens)
            mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
        meta.sliding = AttentionMetadata(slot_mapping=slots, block_size=BLOCK_SIZE, window=window,
                                         prefills=[PrefillChunk(0, num_tokens, num_tokens, None, mask)])
    hidden = runner.model(torch.tensor(chunk), torch.arange(num_tokens), runner.kv_caches, meta)
    return runner.model.compute_logits(hidden[first: num_tokens - 1]).float()
