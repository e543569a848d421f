"""Where a decode step's time goes: the engine alone (no HTTP), three workloads.

    python bench/step_profile.py                 # step times, three workloads
    python bench/step_profile.py --profile       # plus torch.profiler's top ops per workload
    python bench/step_profile.py --dtype bfloat16 --steps 64
    python bench/step_profile.py --quantization none      # float weights (GGUF blocks off)
    python bench/step_profile.py --quant-activations dtype  # blocks met by bfloat16 activations
    python bench/step_profile.py --native-layers both --rounds 3  # decode stack on/off, alternated
    TOKENWAY_NATIVE=0 python bench/step_profile.py       # torch operators only (no C++ kernels)

Workloads (every request decodes with ignore_eos, greedy):
  single     1 request, short prompt;
  batch16    16 requests, short prompts (30-60 tokens);
  shared16   16 requests behind one ~1,000-token shared prefix (prefix-cached after the first).
Step time is measured over decode-only steps (all requests past their prompts), so the
figure is TPOT without HTTP; the split is runner (model forward), sampler and the rest
(scheduler + bookkeeping).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway import LLM, SamplingParams  # noqa: E402
from tokenway.config import DEFAULT_MODEL  # noqa: E402


def prompts_for(workload: str, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    if workload == "single":
        return [tokens(40)]
    if workload == "batch16":
        return [tokens(rng.randint(30, 60)) for _ in range(16)]
    shared = tokens(1000)
    return [shared + tokens(rng.randint(10, 30)) for _ in range(16)]


class Timed:
    """Wraps a callable and accumulates the wall time of its calls."""

    def __init__(self, fn) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - started


def run(llm: LLM, workload: str, steps: int, profile: bool, label: str = "") -> None:
    core = llm.engine
    prompts = prompts_for(workload, core.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    if workload == "shared16":  # warm the prefix cache, as a server with a common system prompt would be
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=1))
    for i, prompt in enumerate(prompts):
        core.add_request(f"{workload}-{i}", prompt, params)
    # Run the prompts through, then a few decode steps to warm up.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()) \
            or core.scheduler.waiting:
        core.step()
    for _ in range(4):
        core.step()

    runner, sampler = Timed(core.runner.execute), Timed(core.sampler)
    core.runner.execute, core.sampler = runner, sampler
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - started)
        runner_time, sampler_time = runner.total, sampler.total  # before the profiled steps add to them
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(8):
                    core.step()
    finally:
        del core.runner.execute  # back to the class's method
        core.sampler = sampler.fn
        core.abort_requests([f"{workload}-{i}" for i in range(len(prompts))])
    total = sum(times)
    batch = len(prompts)
    print(f"{workload:9s}{label} batch {batch:2d}: step p50 {statistics.median(times) * 1e3:6.1f} ms  "
          f"({batch / statistics.median(times):6.1f} tok/s)  runner {runner_time / total:4.0%}  "
          f"sampler {sampler_time / total:4.0%}  other {1 - (runner_time + sampler_time) / total:4.0%}",
          flush=True)
    if profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--workloads", default="single,batch16,shared16")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none"))
    parser.add_argument("--quant-activations", default="auto", choices=("auto", "int8", "dtype"))
    parser.add_argument("--native-layers", default="on", choices=("on", "off", "both"),
                        help="decode-only steps' layers in one native call (models/decode_stack.py)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat each workload (with both: alternating)")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, quantization=args.quantization,
              quant_activations=args.quant_activations)
    model = llm.engine.model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {llm.engine.dtype}, "
          f"{model.num_quantized_matmuls} matmuls on GGUF blocks, native decode attention "
          f"{'on' if llm.engine.runner.decode_kernel is not None else 'off'}")
    stack = model.decode_stack
    modes = {"on": ["on"], "off": ["off"], "both": ["on", "off"]}[args.native_layers]
    if "on" in modes and stack is None:
        print("(no decode stack for this model: every step runs the Python layer loop)")
    for workload in args.workloads.split(","):
        for _ in range(args.rounds):
            for mode in modes:
                model.decode_stack = stack if mode == "on" else None
                run(llm, workload, args.steps, args.profile, f" layers {mode:3s}" if len(modes) > 1 else "")


if __name__ == "__main__":
    main()
