"""What an engine step costs, learned from the steps it ran, and the batch work that a bound on
the slowdown of interactive requests allows beside them.

A step's time on this hardware is close to linear in the tokens it computes: a fixed part (the
weights are read once a step, whatever the batch) and a part per token (the products, and the
attention). A batch token costs more than an average one (its sequence's outputs folded and
sent, the HTTP side's work for its line, on the same cores), so StepCost fits a plane, the
step's whole cycle against its interactive and its batch tokens apart, and a line on all tokens
to stand in until both vary enough to tell apart (least squares, the older steps weighing less:
it follows the machine as it is now, other load and the context lengths of the moment).

BatchAllowance turns a bound on the slowdown ("a step with batch work may take 25% longer than
the same step without it") into tokens: while interactive requests run, batch requests may add
up to bound * cost(interactive tokens) of time, that is bound * cost / cost_per_batch_token
tokens (bench/batch_bench.py: the line alone let TPOT rise 30% at a 25% bound; the plane, 15%).
What a step leaves of its allowance is carried to the next (up to one step's worth), so a bound
worth half a token a step still lets the batch advance a token every other step.

Two more rules keep an interactive request's first token as fast as without the batch:

- a step that prefills an interactive request adds no batch work (its time is the request's
  time to first token, the figure that matters most to a caller);
- while interactive traffic is recent (RECENT_S) but nothing interactive runs this step, a step
  of batch work alone may cost what an interactive step costs (their recent size, times 1 +
  bound): a request that arrives meanwhile waits for the end of a step no longer than the ones
  it would have met anyway. With no interactive traffic for RECENT_S, the batch has the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Each new step's weight against the ones before: the fit follows the last ~100 steps.
DECAY = 0.99
# A fit needs the token counts of the recent steps to differ this much (their variance, in
# tokens^2) before its slope is trusted; until then a step's time is taken as proportional to
# its tokens, which overstates what each token costs, and so allows less batch work, not more.
MIN_VARIANCE = 0.25
# How long after the last interactive request ran batch work alone is still held to the size of
# an interactive step: the gap between a client's calls, with room to spare.
RECENT_S = 2.0
INTERACTIVE_WEIGHT = 0.1  # each step's weight in the average of the interactive tokens a step
UNBOUNDED = 1 << 62


class StepCost:
    """Exponentially weighted least squares of a step's seconds: a line against the tokens it
    computed (line), and a plane against its interactive and its batch tokens apart (plane),
    which measures what a batch token costs the step, whatever the tokens beside it."""

    def __init__(self, decay: float = DECAY) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        # Weighted sums: w, a (interactive tokens), b (batch tokens), y (seconds), and products.
        self._w = self._a = self._b = self._y = 0.0
        self._aa = self._bb = self._ab = self._ay = self._by = 0.0

    def observe(self, num_tokens: int, seconds: float, num_batch_tokens: int = 0) -> None:
        """A step of num_tokens tokens, num_batch_tokens of them the batch class's."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0 or not 0 <= num_batch_tokens <= num_tokens:
            return
        a, b, d = num_tokens - num_batch_tokens, num_batch_tokens, self.decay
        self._w = d * self._w + 1.0
        self._a, self._b, self._y = d * self._a + a, d * self._b + b, d * self._y + seconds
        self._aa, self._bb, self._ab = d * self._aa + a * a, d * self._bb + b * b, d * self._ab + a * b
        self._ay, self._by = d * self._ay + a * seconds, d * self._by + b * seconds

    def line(self) -> tuple[float, float] | None:
        """(seconds a step costs whatever its tokens, seconds each token adds); None before any step."""
        w = self._w
        if w == 0.0:
            return None
        x, y = self._a + self._b, self._y
        xx = self._aa + 2 * self._ab + self._bb
        xy = self._ay + self._by
        variance = xx / w - (x / w) ** 2
        if variance >= MIN_VARIANCE:
            slope = (xy / w - (x / w) * (y / w)) / variance
            intercept = (y - slope * x) / w
            if slope > 0 and intercept >= 0:
                return intercept, slope
        return 0.0, y / x  # the steps alike in size, or a fit that makes no physical sense

    def plane(self) -> tuple[float, float, float] | None:
        """(seconds a step costs, seconds an interactive token adds, seconds a batch token adds);
        None until the recent steps' interactive and batch tokens vary enough, and apart enough,
        to tell the two costs apart (or where the fit makes no physical sense)."""
        w = self._w
        if w == 0.0:
            return None
        ma, mb, my = self._a / w, self._b / w, self._y / w
        saa, sbb, sab = self._aa / w - ma * ma, self._bb / w - mb * mb, self._ab / w - ma * mb
        say, sby = self._ay / w - ma * my, self._by / w - mb * my
        det = saa * sbb - sab * sab
        if saa < MIN_VARIANCE or sbb < MIN_VARIANCE or det < MIN_VARIANCE * MIN_VARIANCE:
            return None
        per_interactive = (say * sbb - sby * sab) / det
        per_batch = (sby * saa - say * sab) / det
        fixed = my - per_interactive * ma - per_batch * mb
        if per_interactive <= 0 or per_batch <= 0 or fixed < 0:
            return None
        return fixed, per_interactive, per_batch


class BatchAllowance:
    """How many batch tokens a step may add beside its interactive ones, under a slowdown bound."""

    def __init__(self, slowdown: float, cost: StepCost | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not math.isfinite(slowdown) or slowdown < 0:
            raise ValueError(f"slowdown must be a finite number >= 0, got {slowdown}")
        self.slowdown = slowdown
        self.cost = cost if cost is not None else StepCost()
        self._clock = clock
        self._credit = 0.0  # tokens allowed and not yet used, carried between steps
        self._interactive_at = float("-inf")  # time.monotonic() an interactive request last ran
        self._interactive_tokens = 0.0  # their tokens a step, lately (an exponential average)

    def tokens(self, num_interactive_tokens: int, prefilling: bool = False) -> int:
        """Batch tokens this step may schedule beside num_interactive_tokens (scheduled before
        them); prefilling: whether one of those is an interactive request's prefill. Report what
        was used with spend()."""
        now = self._clock()
        if prefilling:
            self._interactive_at = now
            return 0
        line = self.cost.line()
        if num_interactive_tokens > 0:
            self._interactive_at = now
            weight = INTERACTIVE_WEIGHT if self._interactive_tokens else 1.0
            self._interactive_tokens += (num_interactive_tokens - self._interactive_tokens) * weight
            plane = self.cost.plane()
            if plane is not None:  # what a batch token costs, measured beside interactive ones
                fixed, per_interactive, per_batch = plane
                allowed = self.slowdown * (fixed + per_interactive * num_interactive_tokens) / per_batch
            elif line is None:  # no step measured yet: as if a step cost its tokens alone
                allowed = self.slowdown * num_interactive_tokens
            else:
                intercept, slope = line
                allowed = self.slowdown * (intercept + slope * num_interactive_tokens) / slope
            self._credit = min(self._credit + allowed, allowed + 1.0)
            return int(self._credit)
        self._credit = 0.0
        if now - self._interactive_at >= RECENT_S:
            return UNBOUNDED  # nothing interactive lately: nothing to slow down
        # Alone, but an interactive request may arrive any moment: a step no longer than theirs.
        intercept, slope = line if line is not None else (0.0, 1.0)
        size = max(1.0, self._interactive_tokens)
        return max(1, int(((1 + self.slowdown) * (intercept + slope * size) - intercept) / slope))

    def spend(self, num_batch_tokens: int) -> None:
        self._credit = max(0.0, self._credit - num_batch_tokens)
