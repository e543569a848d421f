"""Structured-output benchmark: what a JSON-schema grammar costs per engine step.

    python bench/structured_output_bench.py

16 chat requests decode at once, the same prompts with and without a JSON-schema
constraint, greedy and sampled. Printed per configuration: the median time of an engine step
in which all 16 requests decode (medians: the machine is shared), and of its two grammar stages
(filling the 16 allowed-token bitmasks in llguidance, and the sampler, which applies them), plus
the schema's compile time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenway import LLM, SamplingParams
from tokenway.engine.core import EngineCore
from tokenway.frontend.structured_output import StructuredOutputManager
from tokenway.protocol.sampling import StructuredOutputSpec

NUM_REQUESTS = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}},
            "required": ["street", "city", "tags"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "email", "address"],
    "additionalProperties": False,
}
TOPICS = ["a pilot", "a baker", "a chess player", "a nurse", "a poet", "a farmer", "a spy", "a chemist",
          "a sailor", "a judge", "a dancer", "a miner", "a teacher", "a wizard", "a plumber", "a critic"]


class Timed:
    """Wraps a callable and records each call's duration."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.durations: list[float] = []

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.durations.append(time.perf_counter() - started)


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Median ms of the steps where every request decodes (and of their grammar stages)."""
    masks, sampler = Timed(core.structured_output.grammar_bitmask), Timed(core.sampler)
    core.structured_output.grammar_bitmask, core.sampler = masks, sampler
    step_ms, mask_ms, sample_ms = [], [], []
    try:
        for i, prompt in enumerate(prompts):
            core.add_request(f"bench-{i}", prompt, params)
        while core.has_unfinished_requests():
            decoding = len(core.scheduler.running) == len(prompts) and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in core.scheduler.running
            )
            started = time.perf_counter()
            core.step()
            if decoding:
                step_ms.append((time.perf_counter() - started) * 1e3)
                mask_ms.append(masks.durations[-1] * 1e3)
                sample_ms.append(sampler.durations[-1] * 1e3)
    finally:
        del core.structured_output.grammar_bitmask  # back to the class's method
        core.sampler = sampler.fn
    return {"steps": len(step_ms), "step": statistics.median(step_ms), "mask": statistics.median(mask_ms),
            "sampler": statistics.median(sample_ms)}


def main() -> None:
    llm = LLM(show_progress=False)
    core = llm.engine
    prompts = [
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {topic} as a JSON person record."}]), add_special_tokens=False)
        for topic in TOPICS[:NUM_REQUESTS]
    ]
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    manager = StructuredOutputManager(llm.tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    started = time.perf_counter()
    manager.compile(spec)
    print(f"{core.dtype}, {NUM_REQUESTS} requests; schema compile {(time.perf_counter() - started) * 1e3:.1f} ms")
    run(core, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    print(f"{'configuration':<32}{'steps':>6}{'step ms':>10}{'masks ms':>10}{'sampler ms':>12}")
    for label, temperature in (("greedy", 0.0), ("temperature 1.0", 1.0)):
        # Unconstrained requests run as many tokens as the constrained ones averaged, so both
        # runs have about as many all-decoding steps.
        constrained = run(core, prompts, SamplingParams(temperature=temperature, seed=0, max_tokens=300,
                                                        structured_output=spec))
        free = run(core, prompts, SamplingParams(temperature=temperature, seed=0, max_tokens=64, ignore_eos=True))
        for name, result in (("unconstrained", free), ("json_schema", constrained)):
            print(f"{name + ', ' + label:<32}{result['steps']:>6}{result['step']:>10.2f}{result['mask']:>10.2f}"
                  f"{result['sampler']:>12.2f}")


if __name__ == "__main__":
    main()
