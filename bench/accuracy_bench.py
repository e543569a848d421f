"""What each weight/activation choice does to the answers: greedy agreement with float32.

    python bench/accuracy_bench.py                  # ~3 min on 2 cores
    python bench/accuracy_bench.py --tokens 48

Reference: the float32 model on float weights (`--dtype float32 --quantization none`). For
each other choice (`--dtype` x `--quantization` x `--quant-activations`) and a fixed set of 16
prompts:

  - identical: prompts whose whole greedy continuation equals the reference's;
  - first divergence: mean number of tokens generated before the first different one;
  - next-token agreement (teacher-forced): at every position of the reference continuation,
    the choice is fed the reference's tokens so far and must pick the reference's next token
    (512 positions with the defaults). A continuation that diverges once is otherwise
    different from there on, so this says how often a single step disagrees;
  - mean |logprob difference| of the reference's chosen token at those positions.

Choices the CPU cannot run (GGUF blocks need AVX512; bfloat16 products need AVX512-BF16,
else they are float32) are run as the engine would run them and labelled by what it chose.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway import LLM, SamplingParams  # noqa: E402
from tokenway.config import DEFAULT_MODEL  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a small robot",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "import numpy as np\n\ndef normalize(v):",
    "The quick brown fox",
    "In 1969, the first humans",
    "A haiku about the sea:\n",
    "The largest planet in our solar system is",
    "SELECT name, email FROM users WHERE",
    "Water boils at",
    "My favourite book is",
    "Translate to French: Good morning, how are you?\n",
]


def load(model: str, dtype: str, quantization: str, activations: str = "dtype") -> LLM:
    return LLM(model, dtype=dtype, quantization=quantization, quant_activations=activations,
               kv_cache_memory="512MiB", show_progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    one_step = SamplingParams(temperature=0, max_tokens=1, logprobs=0, ignore_eos=True)
    reference = load(args.model, "float32", "none")
    prompts = [reference.tokenizer.encode(text) for text in PROMPTS]
    ref_out = [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    forced = [prompt + ref[:i] for prompt, ref in zip(prompts, ref_out) for i in range(len(ref))]
    ref_steps = reference.generate([{"prompt_token_ids": p} for p in forced], one_step)
    ref_logprobs = [o.outputs[0].logprobs[0].logprob for o in ref_steps]
    del reference

    print(f"{args.model}: {len(PROMPTS)} prompts x {args.tokens} greedy tokens; reference float32, float weights")
    print(f"{'choice':50s} {'identical':>9s} {'first divergence':>17s} {'next-token agreement':>21s} "
          f"{'mean |dlogprob|':>16s}")
    choices = (("bfloat16", "none", "dtype"), ("float32", "auto", "dtype"), ("bfloat16", "auto", "dtype"),
               ("bfloat16", "auto", "int8"))
    for dtype, quantization, activations in choices:
        llm = load(args.model, dtype, quantization, activations)
        model = llm.engine.model
        products = {kernel.products for kernel in model.quant_kernels()}
        label = f"{str(model.dtype).removeprefix('torch.')}, " + (
            f"{model.num_quantized_matmuls} matmuls on GGUF blocks ({'/'.join(sorted(products))} products)"
            if model.num_quantized_matmuls else "float weights")
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
        identical = sum(out == ref for out, ref in zip(outs, ref_out))
        divergence = statistics.mean(
            next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref)) for out, ref in zip(outs, ref_out))
        steps = llm.generate([{"prompt_token_ids": p} for p in forced], one_step)
        targets = [ref[i] for ref in ref_out for i in range(len(ref))]
        agree = sum(o.outputs[0].token_ids[0] == t for o, t in zip(steps, targets)) / len(targets)
        # The reference token's logprob where it is still this choice's pick (else it is not reported).
        diffs = [abs(o.outputs[0].logprobs[0].logprob - lp) for o, t, lp in zip(steps, targets, ref_logprobs)
                 if o.outputs[0].token_ids[0] == t]
        print(f"{label:50s} {identical:6d}/{len(PROMPTS):<2d} {divergence:13.1f} tok {agree * 100:18.1f}% "
              f"{statistics.mean(diffs):16.4f}")
        del llm


if __name__ == "__main__":
    main()
