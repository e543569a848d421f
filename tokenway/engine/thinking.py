"""ThinkingState: where a request's output is in a reasoning model's thinking part, under the
budget its SamplingParams.reasoning_budget (protocol/sampling.py ReasoningBudget) sets.

    Request.__post_init__          thinking = ThinkingState.start(budget) (starts_open: open already)
    SamplingMetadata.from_requests forced_token_ids(output, drafts): per row, the token it must emit
    Sampler                        overwrites those rows' sampled tokens (logprobs stay the model's)
    Scheduler.update_from_output   advance(output) after each appended token

The part opens when the output's last tokens equal start_token_ids (or from the start with
starts_open) and closes for good when they equal end_token_ids. Tokens appended while it is open
are counted; once max_tokens are spent and it is still open, the next tokens are forced: the
rest of end_token_ids, one a step, so that the output ends with end_token_ids and the part closes
as if the model had closed it. "The rest": where the output already ends with the first tokens of
the sequence ("</think>" of "</think>\\n\\n"), only the tokens after them, so it never reads
"</think></think>\\n\\n".

The state changes only as tokens are appended, so preemption and recompute, which append
nothing, leave it as it is. A structured-output grammar constrains the answer only: it waits here
(`grammar`) until the part closes, then becomes the request's (Scheduler.update_from_output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenway.frontend.structured_output import GrammarMatcher
from tokenway.protocol.sampling import ReasoningBudget


@dataclass(slots=True)
class ThinkingState:
    budget: ReasoningBudget
    is_open: bool = False
    is_closed: bool = False  # closed for good: nothing more is counted or forced
    num_thinking_tokens: int = 0  # output tokens appended while the part was open
    # The index in end_token_ids of the next token to force; None while nothing is forced.
    forced_index: int | None = None
    # The request's structured-output grammar while the part is not closed (then Request.grammar).
    grammar: GrammarMatcher | None = None

    @classmethod
    def start(cls, budget: ReasoningBudget, grammar: GrammarMatcher | None = None) -> ThinkingState:
        state = cls(budget, is_open=budget.starts_open, grammar=grammar)
        if state.is_open and budget.max_tokens == 0:
            state.forced_index = 0  # the end sequence comes first
        return state

    @property
    def forced_token_id(self) -> int | None:
        """The token the request must emit next; None: whatever it samples."""
        return None if self.forced_index is None else self.budget.end_token_ids[self.forced_index]

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        """Takes the token just appended, output_token_ids[-1] (only the last few tokens are read).
        Returns whether the part closed with it."""
        if self.is_closed:
            return False
        budget = self.budget
        if not self.is_open:
            self.is_open = _ends_with(output_token_ids, budget.start_token_ids)
            if self.is_open and budget.max_tokens == 0:
                self.forced_index = 0
            return False
        self.num_thinking_tokens += 1
        end = budget.end_token_ids
        if self.forced_index is not None:
            assert output_token_ids[-1] == end[self.forced_index], "a forced row emits its forced token"
            self.forced_index += 1
        if _ends_with(output_token_ids, end):
            self.is_open, self.is_closed, self.forced_index = False, True, None
            return True
        if self.forced_index is None and self.num_thinking_tokens >= budget.max_tokens:
            self.forced_index = _overlap(output_token_ids, end, self.num_thinking_tokens)
        return False

    def forced_token_ids(self, output_token_ids: Sequence[int], drafts: Sequence[int]) -> list[int | None] | None:
        """Per row of a step that verifies drafts (len(drafts) + 1 rows; row j: the request as if it
        had emitted drafts[:j]), the token it must emit or None; None when no row must emit one.
        Rows after one whose draft is not its forced token are left free: the verification drops
        them."""
        if self.is_closed:
            return None
        rows = [self.forced_token_id]
        if drafts:
            state = replace(self, grammar=None)
            width = max(len(self.budget.start_token_ids), len(self.budget.end_token_ids))
            tail = list(output_token_ids[max(0, len(output_token_ids) - width):])
            for draft in drafts:
                if rows[-1] is not None and draft != rows[-1]:
                    rows += [None] * (len(drafts) + 1 - len(rows))
                    break
                tail.append(draft)
                state.advance(tail)
                rows.append(state.forced_token_id)
        return rows if any(token_id is not None for token_id in rows) else None


def _ends_with(token_ids: Sequence[int], suffix: tuple[int, ...]) -> bool:
    n = len(suffix)
    return 0 < n <= len(token_ids) and tuple(token_ids[len(token_ids) - n:]) == suffix


def _overlap(token_ids: Sequence[int], end: tuple[int, ...], num_thinking_tokens: int) -> int:
    """The length of the longest proper prefix of end that the thinking part's last tokens already
    are (at most num_thinking_tokens of them: nothing before the part counts)."""
    for length in range(min(len(end) - 1, num_thinking_tokens), 0, -1):
        if _ends_with(token_ids, end[:length]):
            return length
    return 0
