"""OpenVINO GenAI as a third peer: output tokens per second at one stream and at 16, on a GGUF it
reads directly (Q4_0, Q8_0, F16), CPU, greedy, every request exactly --max-tokens long.

    $PEERS_DIR/openvino-venv/bin/python bench/openvino_peer.py MODEL.Q4_0.gguf [--max-tokens 64]

c=1: LLMPipeline, the requests one after another. c=16: ContinuousBatchingPipeline, 16 requests
in one generate() call (its scheduler batches them). Prints one JSON line; where the file does not
load, {"error": ...} and exit status 1. Runs in its own venv (pip install openvino-genai): it is
no dependency of tokenway. Offline, no HTTP: its figures carry no server overhead, unlike the
llama-server and tokenway columns beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPTS = [f"Question {i}: tell me about the history of the number {i * 7 + 3}." for i in range(64)]


def config(ov, max_tokens: int):
    generation = ov.GenerationConfig()
    generation.max_new_tokens = max_tokens
    generation.min_new_tokens = max_tokens
    generation.ignore_eos = True
    generation.do_sample = False
    return generation


def single_stream(ov, path: str, threads: int, max_tokens: int, num_requests: int) -> float:
    pipe = ov.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads)
    generation = config(ov, max_tokens)
    pipe.generate(PROMPTS[0], generation)  # warm-up: compilation
    started = time.perf_counter()
    for prompt in PROMPTS[:num_requests]:
        pipe.generate(prompt, generation)
    return num_requests * max_tokens / (time.perf_counter() - started)


def batched(ov, path: str, threads: int, max_tokens: int, concurrency: int) -> float:
    scheduler = ov.SchedulerConfig()
    scheduler.cache_size = 1  # GB of KV cache
    scheduler.max_num_seqs = concurrency
    pipe = ov.ContinuousBatchingPipeline(path, scheduler, "CPU", {"INFERENCE_NUM_THREADS": threads})
    generation = config(ov, max_tokens)
    pipe.generate(PROMPTS[:2], [generation] * 2)  # warm-up
    prompts = PROMPTS[:concurrency * 2]
    started = time.perf_counter()
    pipe.generate(prompts, [generation] * len(prompts))
    return len(prompts) * max_tokens / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=4, help="c=1 requests, one after another")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    result: dict = {"peer": "openvino-genai", "gguf": args.gguf}
    try:
        import openvino_genai as ov

        result["version"] = ov.__version__
        result["c1_tok_s"] = single_stream(ov, args.gguf, args.threads, args.max_tokens, args.num_requests)
        result[f"c{args.concurrency}_tok_s"] = batched(ov, args.gguf, args.threads, args.max_tokens, args.concurrency)
    except Exception as exc:  # a peer that cannot load the file is a result to report, not a crash
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
