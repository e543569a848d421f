"""What KV cache groups save on a model whose layers mix sliding-window and full attention.

    python bench/kv_groups_bench.py [--model tests/.gemma3/gemma-3-270m-q4_k_m.gguf] [--kv-cache-memory 1GiB]
        [--lengths 4096,16384] [--max-num-seqs 128,32,16] [--dtype bfloat16] [--no-generate]

"before" is one pool whose blocks hold every layer (the layout before groups), "after" the split
kv_cache/interface.plan_groups makes for the same memory. For each request length it prints the
KV bytes one request holds once its prompt is in and it decodes, and how many such requests the
cache holds at once: a real KVCacheManager (no model) takes requests of that length one after
another, each prefilled in chunks of the step's token budget then decoding, until one does not fit.

Unless --no-generate, the model then generates greedily from a prompt longer than its window
under both layouts (forced by max_num_seqs: plan_groups keeps one pool when the memory cannot
hold max_num_seqs windows) and the tokens are compared.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from tokenway.config import parse_bytes
from tokenway.engine.request import Request
from tokenway.engine.runner import kv_bytes_per_block
from tokenway.kv_cache.interface import KVCacheGroupSpec, plan_groups
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.models.config import ModelConfig
from tokenway.models.loader import resolve_model
from tokenway.protocol.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent / "tests" / ".gemma3" / "gemma-3-270m-q4_k_m.gguf"


def layouts(config: ModelConfig, memory: int, layer_block_bytes: int, block_size: int, max_num_seqs: int,
            budget: int, max_model_len: int) -> dict[str, tuple[KVCacheGroupSpec, ...]]:
    num_layers = config.num_hidden_layers
    one_pool = KVCacheGroupSpec(memory // (num_layers * layer_block_bytes), config.uniform_window, num_layers)
    windows = [config.window(layer) for layer in range(num_layers)]
    return {"before": (one_pool,),
            "after": plan_groups(memory, layer_block_bytes, windows, block_size, max_num_seqs, budget, max_model_len)}


def held_bytes(kv: KVCacheManager, request_id: str, layer_block_bytes: int) -> int:
    return sum(sum(block_id != group.null_block for block_id in group.get_block_ids(request_id))
               * group.spec.num_layers * layer_block_bytes for group in kv.groups)


def run_at_once(groups: tuple[KVCacheGroupSpec, ...], length: int, block_size: int, max_num_seqs: int,
                budget: int, layer_block_bytes: int) -> tuple[int, int]:
    """(bytes the first request holds once decoding, how many requests of `length` tokens are held
    at once): requests come one after another, each prefilled in chunks of the step's token budget
    and then decoding, as the scheduler runs them, until one does not fit or max_num_seqs run."""
    kv = KVCacheManager(block_size=block_size, groups=groups)
    rng = random.Random(0)
    first_bytes = 0
    for index in range(max_num_seqs):
        prompt = [rng.randrange(1, 30000) for _ in range(length)]  # distinct: no prefix-cache hits
        request = Request(f"r{index}", prompt, SamplingParams(temperature=0))
        while request.num_computed_tokens < length:
            num_new = min(budget, length - request.num_computed_tokens)
            if kv.allocate_slots(request, num_new) is None:
                return first_bytes, index
            request.num_computed_tokens += num_new
        request.append_output_token_ids(1)
        if kv.allocate_slots(request, 1) is None:
            return first_bytes, index
        request.num_computed_tokens += 1
        first_bytes = first_bytes or held_bytes(kv, request.request_id, layer_block_bytes)
    return first_bytes, max_num_seqs


def generate(model: str, dtype: str, memory: str, max_num_seqs: int, prompt_ids: list[int]) -> tuple[list[int], int]:
    from tokenway.engine.llm import LLM

    llm = LLM(model, dtype=dtype, kv_cache_memory=memory, max_model_len=4096, max_num_seqs=max_num_seqs,
              show_progress=False)
    outputs = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True))
    return list(outputs[0].outputs[0].token_ids), len(llm.engine.kv_manager.groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--max-num-seqs", default="128,32,16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", help="the KV cache's (bfloat16 where the CPU has bf16)")
    parser.add_argument("--no-generate", action="store_true")
    args = parser.parse_args()

    config = ModelConfig.from_dir(resolve_model(args.model))
    memory = parse_bytes(args.kv_cache_memory, "kv_cache_memory")
    bs, budget = args.block_size, args.max_num_batched_tokens
    layer_block_bytes = kv_bytes_per_block(config, bs, getattr(torch, args.dtype)) // config.num_hidden_layers
    lengths = [int(n) for n in args.lengths.split(",")]
    num_sliding = sum(config.is_sliding(layer) for layer in range(config.num_hidden_layers))
    print(f"{Path(args.model).name}: {config.num_hidden_layers} layers, {num_sliding} with a "
          f"{config.sliding_window}-key window; KV cache {args.kv_cache_memory} of {args.dtype}, blocks of {bs}, "
          f"{budget} tokens a step")
    for max_num_seqs in (int(n) for n in args.max_num_seqs.split(",")):
        plans = layouts(config, memory, layer_block_bytes, bs, max_num_seqs, budget, max(lengths) + 64)
        print(f"\nmax_num_seqs {max_num_seqs}: " + "; ".join(
            f"{name}: " + " + ".join(f"{g.num_blocks} blocks x {g.num_layers} layers"
                                    + (f" (window {g.window})" if g.window else "") for g in groups)
            for name, groups in plans.items()))
        for length in lengths:
            row = []
            for name, groups in plans.items():
                held, most = run_at_once(groups, length, bs, max_num_seqs, budget, layer_block_bytes)
                row.append(f"{name} {held / 2**20:7.1f} MiB a request, {most:3d} at once")
            print(f"  {length:6d} tokens: " + " | ".join(row))

    if not args.no_generate:
        rng = random.Random(1)
        prompt_ids = [2] + [rng.randrange(1000, 200000) for _ in range(3 * config.sliding_window)]
        before, num_groups_before = generate(args.model, args.dtype, "256MiB", 128, prompt_ids)
        after, num_groups_after = generate(args.model, args.dtype, "256MiB", 4, prompt_ids)
        assert (num_groups_before, num_groups_after) == (1, 2)
        agree = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
        print(f"\ngreedy, {len(prompt_ids)}-token prompt, 24 tokens: one pool and groups agree on {agree}/24 "
              f"({'equal' if before == after else 'differ'})")


if __name__ == "__main__":
    main()
