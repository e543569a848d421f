"""N-gram speculative decoding (prompt lookup): drafts from the request's own context.

One decode stream is bound by reading every weight once per token. Verifying k drafted tokens
in one forward (k + 1 query tokens, weights read once) goes past that floor whenever the
drafts are right. Outputs that copy spans of their prompt (code edits, rewrites, lists,
quotes) are drafted well by looking up the latest tokens earlier in the context, as vLLM's
`ngram` method and llama.cpp's lookup decoding do:

    scheduler.schedule()      a decode request gets drafts = proposer.propose(all_token_ids, k)
                              and is scheduled for 1 + len(drafts) tokens (a verify chunk)
    runner.execute()          logits for all 1 + len(drafts) positions
    sampler()                 per position the token the request would emit there; greedy: the
                              argmax; sampled: the draft accepted with probability p(draft), else
                              a draw from the residual (rejection sampling, exact in distribution)
    update_from_output()      keeps the accepted drafts and the token after them

Drafts live only in the step's SchedulerOutput, never in Request.all_token_ids: the KV cache
manager caches a block only once it is full of known tokens, so no block is ever cached
holding a rejected draft.

Not drafted for: requests under a structured-output grammar, or with one waiting for their
thinking part to close (each draft would have to pass the grammar before the model sees it),
and the last token a request may still emit (max_tokens, the context window). Every other
sampling parameter holds per verified position: penalties and min_tokens count the drafts
before it, logprobs come from its raw logits, a reasoning budget forces the token it would force
there (engine/thinking.py), and a stop token or stop string inside an accepted run ends the
output there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Finds the longest n-gram (prompt_lookup_max down to prompt_lookup_min tokens) ending the
    context that occurs earlier in it, and proposes the tokens that followed its earliest
    occurrence (vLLM's choice: the earliest one has the most tokens after it)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be in [1, prompt_lookup_max "
                             f"({self.prompt_lookup_max})]")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}")

    def propose(self, token_ids: Sequence[int], max_num_tokens: int | None = None) -> tuple[int, ...]:
        """Up to min(num_speculative_tokens, max_num_tokens) drafts to follow token_ids; () when
        no n-gram of at least prompt_lookup_min tokens recurs. O(len * prompt_lookup_max) in numpy."""
        k = self.num_speculative_tokens if max_num_tokens is None else min(self.num_speculative_tokens, max_num_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.prompt_lookup_min:
            return ()
        tokens = np.fromiter(token_ids, dtype=np.int64, count=num_tokens)
        # Candidate occurrences end at e in [0, num_tokens - 2] (a token must follow them).
        # match_len[e]: how many of the context's last tokens (up to prompt_lookup_max) end at e too.
        head = tokens[:-1]
        run = head == tokens[-1]  # (num_tokens - 1,) the run of matches so far still holds
        match_len = run.astype(np.int32)
        for back in range(1, min(self.prompt_lookup_max, num_tokens - 1)):
            run[back:] &= head[:-back] == tokens[-1 - back]
            run[:back] = False  # the n-gram would start before the context
            match_len += run
        best = int(match_len.max())
        if best < self.prompt_lookup_min:
            return ()
        start = int(np.argmax(match_len == best)) + 1  # the earliest longest occurrence
        return tuple(tokens[start: start + k].tolist())


@dataclass(slots=True)
class SpecDecodingStats:
    """Counts since start, in vLLM's names: a draft is one request's run of drafted tokens in
    one step; accepted tokens are the drafts the verification kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens; 0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields on average: the accepted drafts plus the model's own next
        token (vLLM's mean acceptance length); 0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
