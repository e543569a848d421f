"""tokenway: the whole path of an LLM API call, as software you run yourself.

    client ── HTTP ──► 1 gateway      ChatCompletionRequest (pydantic), Principal
                       2 routing      model name → pool → replica
                       3 frontend     Tokenizer: chat template → prompt_token_ids; SamplingParams
                       4 engine       Request → Scheduler → SchedulerOutput → ModelRunner → logits
                                      → Sampler → EngineOutput (new token ids per request)
                       6 postprocess  RequestState: detokenize, stop strings → RequestOutput
                       7 billing      usage (prompt, cached, completion tokens)
    client ◄── JSON or SSE ──

Request is owned by the Scheduler from arrival to finish; KV blocks and the prefix-cache
hash map by the KV cache manager's BlockPool; SamplingParams is immutable.
"""

import os
import sys
from typing import TYPE_CHECKING, Any

# tokenway's kernels run on their own helper threads (csrc/pool.h). torch's OpenMP team, which
# still runs the ATen operators between them, spins after each of its regions by default and so
# takes a core from those helpers: prefill of the default model ran 20-30% slower. Passive, its
# threads sleep at once. libgomp reads this when torch loads, so only before that, and never over
# the user's own setting.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from tokenway.engine.llm import LLM
    from tokenway.frontend.output import CompletionOutput, RequestOutput
    from tokenway.protocol.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import tokenway.kv_cache` does not load torch models and tokenizers.
    if name == "LLM":
        from tokenway.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenway.protocol.sampling import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenway.frontend import output

        return getattr(output, name)
    raise AttributeError(f"module 'tokenway' has no attribute {name!r}")
