"""Engine benchmark: tokenway against HuggingFace transformers on the same machine, same run.

    python bench/engine_bench.py            # full run (a few minutes on 2 cores)
    python bench/engine_bench.py --quick    # fewer requests, for a smoke check

(a) 64 requests, prompts of 32-256 tokens, 128 output tokens each (ignore_eos):
    output tokens/s of tokenway (all at once) vs transformers (one after another).
(b) single-stream decode tokens/s of both.
(c) time to first token of a 1,000-token prompt, cold and with its prefix cached.
(d) peak RSS of this process.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway import LLM, SamplingParams  # noqa: E402
from tokenway.models.loader import DEFAULT_MODEL, resolve_model  # noqa: E402


def make_prompts(vocab_size: int, count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Random ordinary tokens (skip the first 100 ids: control tokens live there).
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(low, high))] for _ in range(count)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_tokenway(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def bench_hf(model, prompts: list[list[int]], output_len: int) -> float:
    started = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
            do_sample=False, pad_token_id=0,
        )
        assert out.shape[1] == len(prompt) + output_len
    return len(prompts) * output_len / (time.perf_counter() - started)


def ttft(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()

    num_requests, output_len, hf_requests = (16, 32, 4) if args.quick else (64, 128, 8)
    llm = LLM(args.model, dtype=args.dtype, show_progress=True)
    vocab = llm.engine.model_config.vocab_size
    prompts = make_prompts(vocab, num_requests, 32, 256)
    print(f"model {args.model}, dtype {llm.engine.dtype}, torch threads {torch.get_num_threads()}")

    bench_tokenway(llm, prompts[:4], 8)  # warm-up
    llm.engine.kv_manager.reset_prefix_cache()
    tw_batch = bench_tokenway(llm, prompts, output_len)
    llm.engine.kv_manager.reset_prefix_cache()
    tw_single = bench_tokenway(llm, prompts[:1], output_len)

    long_prompt = make_prompts(vocab, 1, 1000, 1000, seed=1)[0]
    llm.engine.kv_manager.reset_prefix_cache()
    cold = ttft(llm, long_prompt)
    cached = ttft(llm, long_prompt)

    print(f"(a) batch of {num_requests}: tokenway {tw_batch:.1f} output tok/s")
    print(f"(b) single stream: tokenway {tw_single:.1f} tok/s")
    print(f"(c) TTFT 1000-token prompt: cold {cold * 1000:.0f} ms, cached {cached * 1000:.0f} ms "
          f"({100 * cached / cold:.1f}% of cold)")
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        model_dir = resolve_model(args.model)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        with torch.inference_mode():
            bench_hf(hf, prompts[:1], 8)  # warm-up
            hf_batch = bench_hf(hf, prompts[:hf_requests], output_len)
            hf_single = bench_hf(hf, prompts[:1], output_len)
        print(f"(a) transformers fp32, one after another ({hf_requests} of the requests): {hf_batch:.1f} tok/s "
              f"-> tokenway is {tw_batch / hf_batch:.1f}x")
        print(f"(b) transformers fp32 single stream: {hf_single:.1f} tok/s -> tokenway is {tw_single / hf_single:.1f}x")
        # For fairness: transformers in the dtype tokenway chose, too.
        if llm.engine.dtype != torch.float32:
            hf = hf.to(llm.engine.dtype)
            with torch.inference_mode():
                bench_hf(hf, prompts[:1], 8)
                hf_batch_same = bench_hf(hf, prompts[:hf_requests], output_len)
                hf_single_same = bench_hf(hf, prompts[:1], output_len)
            print(f"    transformers {llm.engine.dtype}: one after another {hf_batch_same:.1f} tok/s "
                  f"(tokenway {tw_batch / hf_batch_same:.1f}x), single stream {hf_single_same:.1f} tok/s "
                  f"(tokenway {tw_single / hf_single_same:.1f}x)")
    print(f"(d) peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
