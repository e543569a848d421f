"""Where a decode step's time goes: the engine alone (no HTTP), three workloads.

    python bench/step_profile.py                 # step times, three workloads
    python bench/step_profile.py --profile       # plus torch.profiler's top ops per workload
    python bench/step_profile.py --dtype bfloat16 --steps 64
    python bench/step_profile.py --quantization none      # float weights (GGUF blocks off)
    python bench/step_profile.py --quant-activations dtype  # blocks met by bfloat16 activations
    python bench/step_profile.py --native-layers both --rounds 3  # decode stack on/off, alternated
    python bench/step_profile.py --model F.gguf --workloads single --split   # where a step's time goes
    TOKENWAY_NATIVE=0 python bench/step_profile.py       # torch operators only (no C++ kernels)

Workloads (every request decodes with ignore_eos, greedy):
  single     1 request, short prompt;
  batch16    16 requests, short prompts (30-60 tokens);
  shared16   16 requests behind one ~1,000-token shared prefix (prefix-cached after the first).
Step time is measured over decode-only steps (all requests past their prompts), so the
figure is TPOT without HTTP; the split is runner (model forward), sampler and the rest
(scheduler + bookkeeping).

--split: each decode step under torch.profiler (the decode stack's operator calls are recorded
too), its time by kind: the block matmuls by type with the bytes they read and the GB/s that is,
the LM head, attention, the small fused steps (norms, RoPE + cache writes, silu), the stack's own
glue, the embedding row, sampling, and the rest of the step (scheduler, the runner's inputs,
Python); medians over the steps, beside a plain read of 1 GiB by as many threads in the same run.
The profiler adds a few microseconds an operator: the step is slower than without it.
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


def weight_kinds(model) -> dict[tuple[int, int], tuple[str, int]]:
    """(groups, bytes per group) of each block weight -> (its kind, bytes): how the profiler's
    input shapes name a matmul."""
    kinds = {}
    for kernel in model.quant_kernels():
        kinds[tuple(kernel.weight.shape)] = (f"matmul {kernel.qtype}", kernel.nbytes)
    head = model.head
    if hasattr(head, "qtype"):  # the head on blocks (a tied head: the embedding's table)
        kinds[tuple(head.weight.shape)] = (f"LM head {head.qtype}", head.nbytes)
    return kinds


SMALL_STEPS = ("rope_and_cache", "add_rms_norm_", "rms_norm", "silu_and_mul")


def split_step(events, kinds: dict[tuple[int, int], tuple[str, int]],
               calls: dict[tuple[str, tuple], list[float]]) -> None:
    """One profiled step's tokenway operators into calls: (kind, weight shape) -> each call's
    seconds."""
    for event in events:
        if not event.name.startswith("tokenway_"):
            continue
        name = event.name.split("::")[-1]
        if name in ("argmax_rows", "parallel_pool"):  # the sampler's, counted in its time; a lookup
            continue
        seconds = event.cpu_time_total / 1e6
        shape: tuple = ()
        if name in ("quant_linear", "quant_linear_out"):
            shape = tuple(event.input_shapes[1])
            kind = kinds.get(shape, ("matmul ?", 0))[0]
        elif name == "decode":  # the stack: its own time less the operators it called
            kind = "stack glue"
            seconds -= sum(c.cpu_time_total / 1e6 for c in event.cpu_children if c.name.startswith("tokenway_"))
        else:
            kind = {"paged_decode_attention": "attention", "embedding": "embedding row"}.get(
                name, "norms, RoPE, silu" if name in SMALL_STEPS else name)
        calls.setdefault((kind, shape), []).append(seconds)


def run_split(llm: LLM, workload: str, steps: int) -> None:
    """Each decode step profiled on its own. Per kind of work: each operator call's median time
    (a call the OS preempted, on cores shared with other work, moves the median little) times its
    calls a step."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quant_bench import plain_read_seconds

    core = llm.engine
    kinds = weight_kinds(core.model)
    prompts = prompts_for(workload, core.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"{workload}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()) \
            or core.scheduler.waiting:
        core.step()
    for _ in range(4):
        core.step()
    sampler = Timed(core.sampler)
    core.sampler = sampler
    calls: dict[tuple[str, tuple], list[float]] = {}
    step_times, cpu_times, sampler_times = [], [], []
    try:
        for _ in range(steps):
            sampler.total = 0.0
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                started, cpu_started = time.perf_counter(), time.thread_time()
                core.step()
                step_times.append(time.perf_counter() - started)
                cpu_times.append(time.thread_time() - cpu_started)
            sampler_times.append(sampler.total)
            split_step(prof.events(), kinds, calls)
    finally:
        core.sampler = sampler.fn
        core.abort_requests([f"{workload}-{i}" for i in range(len(prompts))])
    read_gbs = (1 << 30) / plain_read_seconds(1 << 30, 5) / 1e9
    rows: dict[str, list[float]] = {}  # kind -> [seconds, bytes] a step
    for (kind, shape), seconds in calls.items():
        row = rows.setdefault(kind, [0.0, 0.0])
        row[0] += statistics.median(seconds) * len(seconds) / steps
        row[1] += kinds.get(shape, ("", 0))[1] * len(seconds) / steps
    rows["sampling (Python)"] = [statistics.median(sampler_times), 0.0]
    step = min(step_times)
    rows["rest of the step"] = [step - sum(seconds for seconds, _ in rows.values()), 0.0]
    print(f"{workload}: step min {step * 1e3:.2f} ms, p50 {statistics.median(step_times) * 1e3:.2f} ms (main thread's "
          f"CPU p50 {statistics.median(cpu_times) * 1e3:.2f} ms) under the profiler, {steps} steps; plain read "
          f"{read_gbs:.1f} GB/s ({torch.get_num_threads()} threads)")
    print(f"  {'kind':22s} {'ms':>7s} {'share':>6s} {'MB':>7s} {'GB/s':>6s} {'of read':>7s}")
    for name, (seconds, num_bytes) in sorted(rows.items(), key=lambda item: -item[1][0]):
        rate = f"{num_bytes / seconds / 1e9:6.1f} {num_bytes / seconds / 1e9 / read_gbs:7.0%}" \
            if num_bytes and seconds > 0 else ""
        print(f"  {name:22s} {seconds * 1e3:7.2f} {seconds / step:6.1%} {num_bytes / 1e6:7.1f} {rate}")
    weights = sum(num_bytes for _, num_bytes in rows.values())
    print(f"  weights read a step: {weights / 1e6:.1f} MB: at the plain read {weights / read_gbs / 1e6:.2f} ms, "
          f"{weights / read_gbs / 1e9 / step:.0%} of the step")


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
    parser.add_argument("--split", action="store_true", help="where each decode step's time goes (see above)")
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
        if args.split:
            run_split(llm, workload, args.steps)
            continue
        for _ in range(args.rounds):
            for mode in modes:
                model.decode_stack = stack if mode == "on" else None
                run(llm, workload, args.steps, args.profile, f" layers {mode:3s}" if len(modes) > 1 else "")


if __name__ == "__main__":
    main()
