"""One stream and pp512, llama.cpp's llama-bench beside tokenway's engine on the same GGUF,
alternated round by round (a shared machine drifts; compare within a round).

    python bench/moe_ab.py FILE.gguf [ROUNDS]

tokenway: LLM, greedy with ignore_eos: tg the decode of 64 tokens, as llama-bench's tg counts
only decode steps: a fresh 16-token prompt to 65 tokens less another fresh 16-token prompt to one
token (prefill and first token taken out); pp512 a fresh 512-token prompt to one token. llama.cpp:
llama-bench -t 2 -p 512 -n 64 with its weight repacking on (its default and its fastest), except
where the CPU lists AMX: there its AMX repack dies of SIGILL on VMs without the tile state, so
--repack 0. LLAMA_REPACK=0|1 overrides. The random-weight files come from
bench/random_moe_gguf.py."""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from tokenway.engine.llm import LLM
from tokenway.native import cpu_flags
from tokenway.protocol.sampling import SamplingParams

path = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenway-peers"))
LB = str(PEERS_DIR / "bin" / "llama-bench")
GREEDY = dict(temperature=0, ignore_eos=True)


REPACK = os.environ.get("LLAMA_REPACK") or ("0" if "amx_tile" in cpu_flags() else "1")


def tokenway_round(llm: LLM, rng: random.Random) -> tuple[float, float]:
    def timed(length: int, max_tokens: int) -> float:
        prompt = [rng.randrange(1000, 40000) for _ in range(length)]  # fresh: no prefix-cache hit
        started = time.time()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, **GREEDY))
        return time.time() - started

    timed(16, 4)  # warm
    decode = 64 / (timed(16, 65) - timed(16, 1))
    return decode, 512 / timed(512, 1)


def llama_cpp_round() -> tuple[float, float]:
    cmd = [LB, "-m", path, "-t", "2", "-p", "512", "-n", "64", "-r", "1", "--repack", REPACK, "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] == 512)
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] == 64)
    return decode, prefill


def main() -> None:
    llm = LLM(path, kv_cache_memory=512 * 2**20, max_model_len=2048, show_progress=False)
    rng = random.Random(0)
    print(f"llama-bench --repack {REPACK}", flush=True)
    for index in range(rounds):
        ours, theirs = tokenway_round(llm, rng), llama_cpp_round()
        print(f"round {index}: tokenway tg {ours[0]:.2f} pp512 {ours[1]:.1f} | llama.cpp tg {theirs[0]:.2f} "
              f"pp512 {theirs[1]:.1f} | load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
