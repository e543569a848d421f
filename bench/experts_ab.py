"""One expert layer, this tree's experts kernel against another tree's, in one process, call by
call alternated: on a shared machine whose speed drifts by 20-40% over minutes, two processes
timed one after the other measure the drift; calls interleaved in one process see the same.

    git worktree add /tmp/base HEAD
    python bench/experts_ab.py /tmp/base --tokens 512 --threads 1
    python bench/experts_ab.py /tmp/base --model qwen3 --types Q4_K,Q4_K --tokens 32,512

The other tree's csrc/experts.cpp is built as its own operator library (tokenway_experts_base,
the flags native.py builds with) beside this tree's; the layer's weights, input and routing are
the same for both (bench/expert_kernel_bench.py's shapes and random blocks, one layer, hot in
cache: the kernel's compute, not the memory). Prints best and median ms of each, the ratio of
the bests, and the largest difference between the two outputs (the same arithmetic: zero, or a
float32 summation order's worth)."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from expert_kernel_bench import MODELS, random_experts  # noqa: E402 (bench/ is the script's directory)

from tokenway import native  # noqa: E402
from tokenway.config import default_cache_dir  # noqa: E402
from tokenway.models.expert_kernels import ExpertSpec, NativeExpertKernel  # noqa: E402


def base_ops(tree: Path):
    source = tree / "tokenway" / "csrc" / "experts.cpp"
    if not source.exists():
        sys.exit(f"{source}: no experts kernel in that tree")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(source.parent.glob("*.[ch]*")))).hexdigest()[:16]
    build_dir = default_cache_dir() / "native" / f"experts-base-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    flags = native.ISA_FLAGS[native.process_isa()][0]
    cpp_extension.load(name="tokenway_experts_base", sources=[str(source)], build_directory=str(build_dir),
                       extra_cflags=["-O3", *flags, "-fopenmp", "-ffast-math", "-fno-finite-math-only",
                                     "-DTOKENWAY_LIBRARY=tokenway_experts_base"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.tokenway_experts_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the other tree (a checkout or worktree)")
    parser.add_argument("--model", choices=MODELS, default="qwen3")
    parser.add_argument("--types", help="gate/up and down types (default: the model's), e.g. Q4_K,Q4_K")
    parser.add_argument("--tokens", default="512", help="comma-separated token counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = MODELS[args.model]
    gate_up, down = args.types.split(",") if args.types else (shape.gate_up, shape.down)
    rng = np.random.default_rng(0)
    e = shape.num_experts
    kernel = NativeExpertKernel(random_experts(e, shape.inter, shape.hidden, gate_up, rng),
                                random_experts(e, shape.inter, shape.hidden, gate_up, rng),
                                random_experts(e, shape.hidden, shape.inter, down, rng), ExpertSpec(shape.activation))
    ops = {"base": base_ops(args.base), "this": kernel.ops}
    print(f"{args.model} {gate_up}/{down}, {args.threads} threads, base {args.base}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, shape.hidden, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:shape.top_k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, shape.top_k, generator=gen), -1)
        times: dict[str, list[float]] = {name: [] for name in ops}
        outputs = {}
        with torch.inference_mode():
            for name, library in ops.items():
                kernel.ops = library
                outputs[name] = kernel(x, ids, weights)  # warm, and the answer
            for _ in range(args.repeats):
                for name, library in ops.items():
                    kernel.ops = library
                    started = time.perf_counter()
                    kernel(x, ids, weights)
                    times[name].append(time.perf_counter() - started)
        best = {name: min(ts) for name, ts in times.items()}
        row = "  ".join(f"{name} best {best[name] * 1e3:.2f} med {sorted(ts)[len(ts) // 2] * 1e3:.2f} ms"
                        for name, ts in times.items())
        diff = (outputs["this"] - outputs["base"]).abs().max() / outputs["base"].abs().max()
        print(f"T={tokens}: {row}  base/this {best['base'] / best['this']:.2f}x  max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
