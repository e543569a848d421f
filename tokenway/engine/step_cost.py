"""What an engine step costs, learned from the steps it ran, and the batch work that a bound on
the slowdown of interactive requests allows beside them.

A step's time on this hardware is close to linear in the tokens it computes: a fixed part (the
weights are read once a step, whatever the batch) and a part per token (the products, and the
attention). A batch token costs more than an average one (its sequence's outputs folded and
sent, the HTTP side's work for its line, on the same cores), so StepCost fits a plane, the
step's whole cycle against its interactive and its batch tokens apart, and a line on all tokens
to stand in until both vary enough to tell apart (least squares, the older steps weighing less:
it follows the machine as it is now, other load and the context lengths of the moment).

BatchAllowance turns a bound on the slowdown ("interactive steps may take 25% longer than they
would without the batch") into tokens, and holds the steps to it by measuring them: while
interactive requests run, each step may spend bound * cost(its interactive tokens alone) of time
on the batch, and a step granted batch work is settled once its cycle is measured (the next
step's start, the steps interjected in it included, since its interactive requests waited
through them too): what it took beyond cost(its interactive tokens and the interjected ones) is
what the batch cost it. A step that cost more than its share takes the excess from the next
steps' shares (up to MAX_DEBT_STEPS of them); one that cost less leaves the rest to the next (up
to one step's share). So the model only sizes the next grant: a batch token dearer than the
plane says, the extra weight reads of a step interjected for an arriving request, the HTTP
side's work for the batch's lines, all show in the measured cycles and are paid back.

cost(interactive tokens alone) is measured on the steps the engine ran holding no batch request
(BatchAllowance.alone) while those are recent (ALONE_FOR_S): the batch's mere presence makes the
same interactive step dearer, even one it takes no token of (bench/batch_bench.py: 5.4 -> 5.9 ms
for 4 decodes), which the plane, fitted beside the batch, counts as the step's own cost. With
the plane as the measure TPOT rose 37-45% at a 25% bound; with these steps, 24-31%.

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
# How many steps' shares a step that overran may take from the next: an interjected step's extra
# weight read is a few shares; a pause of the whole machine is not the batch's to repay.
MAX_DEBT_STEPS = 4
# How long what steps cost without the batch stays the measure of what they would cost now: past
# it (a batch running for long beside interactive traffic) the plane stands in, which knows only
# steps beside the batch, and so counts its presence as part of the steps' cost.
ALONE_FOR_S = 120.0
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
    """How many batch tokens a step may add beside its interactive ones, under a slowdown bound:
    tokens() sizes a step's grant; observe() measures each step, settling the one granted."""

    def __init__(self, slowdown: float, cost: StepCost | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not math.isfinite(slowdown) or slowdown < 0:
            raise ValueError(f"slowdown must be a finite number >= 0, got {slowdown}")
        self.slowdown = slowdown
        self.cost = cost if cost is not None else StepCost()
        # Steps taken while the engine held no batch request: what interactive steps cost without
        # the batch, as of _alone_at (its presence costs them even in steps it takes no token of).
        self.alone = StepCost()
        self._alone_at = float("-inf")
        self._clock = clock
        self._credit_s = 0.0  # of the batch's time beside interactive steps, left over (< 0: overspent)
        # The step granted last and not settled yet: (its interactive tokens' cost, seconds an
        # interactive token adds), as the model had them then.
        self._granted: tuple[float, float] | None = None
        self._interactive_at = float("-inf")  # time.monotonic() an interactive request last ran
        self._interactive_tokens = 0.0  # their tokens a step, lately (an exponential average)

    def costs(self) -> tuple[float, float, float] | None:
        """(seconds a step costs, seconds an interactive token adds, seconds a batch token adds):
        the plane, or the line on all tokens until the plane can be told; the first two from the
        steps without the batch where they are recent (ALONE_FOR_S); None before any step."""
        plane = self.cost.plane()
        if plane is None:
            line = self.cost.line()
            plane = None if line is None else (line[0], line[1], line[1])
        alone = self.alone.line() if self._clock() - self._alone_at < ALONE_FOR_S else None
        if plane is None or alone is None:
            return plane
        return alone[0], alone[1], plane[2]

    def tokens(self, num_interactive_tokens: int, prefilling: bool = False) -> int:
        """Batch tokens this step may schedule beside num_interactive_tokens (scheduled before
        them); prefilling: whether one of those is an interactive request's prefill."""
        now = self._clock()
        self._granted = None
        if prefilling:
            self._interactive_at = now
            return 0
        if num_interactive_tokens > 0:
            self._interactive_at = now
            weight = INTERACTIVE_WEIGHT if self._interactive_tokens else 1.0
            self._interactive_tokens += (num_interactive_tokens - self._interactive_tokens) * weight
            costs = self.costs()
            if costs is None:  # no step measured yet: as if a step cost its tokens alone
                return int(self.slowdown * num_interactive_tokens)
            fixed, per_interactive, per_batch = costs
            alone_s = fixed + per_interactive * num_interactive_tokens
            self._granted = (alone_s, per_interactive)
            return max(0, int((self._credit_s + self.slowdown * alone_s) / per_batch))
        self._credit_s = 0.0
        if now - self._interactive_at >= RECENT_S:
            return UNBOUNDED  # nothing interactive lately: nothing to slow down
        # Alone, but an interactive request may arrive any moment: a step no longer than theirs.
        line = self.cost.line()
        intercept, slope = line if line is not None else (0.0, 1.0)
        size = max(1.0, self._interactive_tokens)
        return max(1, int(((1 + self.slowdown) * (intercept + slope * size) - intercept) / slope))

    def observe(self, num_tokens: int, num_batch_tokens: int, cycle_s: float, interjected_s: float = 0.0,
                num_interjected_tokens: int = 0, batch_held: bool = True) -> None:
        """A step's measured cycle, the steps interjected in it included (interjected_s of it;
        num_interjected_tokens: theirs, which would have shared its step without the batch);
        batch_held: whether the engine holds batch requests, running or waiting."""
        self.cost.observe(num_tokens, cycle_s - interjected_s, num_batch_tokens)
        if not batch_held:
            self.alone.observe(num_tokens, cycle_s)
            self._alone_at = self._clock()
        if self._granted is None or not math.isfinite(cycle_s):
            return
        alone_s, per_interactive = self._granted
        self._granted = None
        share_s = self.slowdown * alone_s
        spent_s = cycle_s - alone_s - per_interactive * num_interjected_tokens
        self._credit_s = min(max(self._credit_s + share_s - spent_s, -MAX_DEBT_STEPS * share_s), share_s)
