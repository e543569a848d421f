"""A bound on what batch work may add to a step (engine/step_cost.py): the cost line learned from
the steps, the batch tokens it allows beside interactive ones (none beside an interactive
prefill), steps of batch work alone no longer than interactive ones while interactive traffic is
recent, and the whole step once it is not; the scheduler keeping to it."""

from __future__ import annotations

import pytest

from tokenway.config import EngineConfig
from tokenway.engine.scheduler import Scheduler
from tokenway.engine.step_cost import BatchAllowance, StepCost
from tokenway.kv_cache.manager import KVCacheManager

from .test_priority import BLOCK, add, make_request, scheduled, step


def cost_of(intercept: float, slope: float, sizes=(1, 4, 9, 16, 33, 64)) -> StepCost:
    cost = StepCost()
    for _ in range(20):
        for num_tokens in sizes:
            cost.observe(num_tokens, intercept + slope * num_tokens)
    return cost


def test_the_cost_line_is_the_steps_own():
    intercept, slope = cost_of(0.002, 0.0004).line()
    assert intercept == pytest.approx(0.002) and slope == pytest.approx(0.0004)
    # Steps all of one size cannot tell the parts apart: every second is taken as the tokens'.
    assert cost_of(0.002, 0.0004, sizes=(8,)).line() == pytest.approx((0.0, (0.002 + 0.0032) / 8))
    assert StepCost().line() is None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_steps(allowance: BatchAllowance, num_steps: int, num_interactive: int = 4,
              cost=lambda a, b: 0.002 + 0.0004 * (a + b)) -> list[int]:
    """num_steps steps of num_interactive interactive tokens and what the allowance grants,
    each step measured at cost(interactive, batch) seconds: the grants."""
    granted = []
    for _ in range(num_steps):
        granted.append(allowance.tokens(num_interactive))
        allowance.observe(num_interactive + granted[-1], granted[-1], cost(num_interactive, granted[-1]))
    return granted


def test_the_allowance_is_the_bound_in_tokens_and_carries_its_fractions():
    clock = Clock()
    allowance = BatchAllowance(0.25, cost_of(0.002, 0.0004), clock)
    # 4 interactive tokens cost 3.6 ms; 25% of that is 0.9 ms: 2.25 tokens' worth a step.
    granted = run_steps(allowance, 8)
    # 8 x 2.25 = 18 (one less where the float's rounding leaves 2.2499...)
    assert set(granted) == {2, 3} and sum(granted) in (17, 18)
    # Granted and not used (no batch work took it), it carries one step's share at most.
    for _ in range(4):
        allowance.tokens(4)
        allowance.observe(4, 0, 0.0036)
    assert allowance.tokens(4) in (4, 5)
    # Beside an interactive prefill: nothing.
    assert allowance.tokens(40, prefilling=True) == 0
    # Nothing interactive this step, but lately: a step the cost of theirs (about 4 tokens lately), 25% more.
    alone = allowance.tokens(0)
    assert 4 <= alone <= 8 and (0.002 + 0.0004 * alone) <= 1.25 * (0.002 + 0.0004 * 8)
    clock.now += 5  # none for a while: the batch has the engine
    assert allowance.tokens(0) >= 1 << 30
    # Before any step is measured, a step is taken to cost its tokens alone: 25% of 4 tokens.
    assert BatchAllowance(0.25).tokens(4) == 1
    with pytest.raises(ValueError):
        BatchAllowance(-0.1)


def test_a_step_that_cost_more_than_its_share_is_paid_back_by_the_next():
    allowance = BatchAllowance(0.25, cost_of(0.002, 0.0004), Clock())
    # Batch tokens that cost three times what the model says: the measured cycles settle it, and
    # the steps' extra time keeps to the bound on average all the same.
    dear = lambda a, b: 0.002 + 0.0004 * a + 0.0012 * b  # noqa: E731
    granted = run_steps(allowance, 400, cost=dear)[-200:]
    extra = sum(dear(4, b) - dear(4, 0) for b in granted) / len(granted)
    assert extra == pytest.approx(0.25 * 0.0036, rel=0.15)
    assert 0 in granted  # steps that repay take none
    # One stall of the whole machine costs the batch a few steps' shares, not the stall's length.
    allowance = BatchAllowance(0.25, cost_of(0.002, 0.0004), Clock())
    allowance.tokens(4)
    allowance.observe(6, 2, 0.5)
    assert sum(run_steps(allowance, 12)) > 0


def test_an_interjected_prefill_is_counted_as_the_interactive_work_it_is():
    def settled(num_interjected_tokens: int) -> int:
        allowance = BatchAllowance(0.25, cost_of(0.002, 0.0004), Clock())
        allowance.tokens(4)
        # 2 batch tokens and a 20-token prefill run between two of the step's layers: without the
        # batch that prefill would have shared the step; only its own step's fixed cost is extra.
        allowance.observe(6, 2, 0.002 + 0.0004 * 6 + 0.002 + 0.0004 * 20, 0.002 + 0.0004 * 20,
                          num_interjected_tokens)
        return sum(run_steps(allowance, 6))

    assert settled(20) > settled(0)


def test_steps_without_the_batch_are_the_measure_while_recent():
    clock = Clock()
    allowance = BatchAllowance(0.25, StepCost(), clock)
    # Steps with no batch request in the engine: 2.4 ms for 4 tokens. Then steps beside the batch,
    # where the same 4 tokens cost 3.6 ms: its presence costs interactive steps even where it
    # takes no token, and the bound is on what they would cost without it.
    for num_tokens in (1, 4, 9, 16) * 30:
        allowance.observe(num_tokens, 0, 0.0008 + 0.0004 * num_tokens, batch_held=False)
    for _ in range(20):
        for interactive in (1, 4, 9, 16):
            for batch in (0, 2, 5, 11):
                allowance.observe(interactive + batch, batch, 0.002 + 0.0004 * (interactive + batch))
    assert allowance.tokens(4) == 1  # 25% of 2.4 ms is 0.6 ms: 1.5 tokens of 0.4 ms
    clock.now += 121  # long ago: the plane, 3.6 ms, is the measure again
    assert allowance.tokens(4) == 2


def make_scheduler(allowance: BatchAllowance | None) -> Scheduler:
    return Scheduler(KVCacheManager(256, BLOCK), max_model_len=256, max_num_batched_tokens=64, max_num_seqs=16,
                     batch_allowance=allowance)


def batch_tokens(out) -> int:
    return sum(n for request_id, n in scheduled(out) if request_id.startswith("b"))


def test_the_scheduler_gives_the_batch_what_the_bound_allows_beside_interactive_requests():
    clock = Clock()
    allowance = BatchAllowance(0.25, cost_of(0.002, 0.0004), clock)
    scheduler = make_scheduler(allowance)

    def measured_step(scheduler: Scheduler):  # as EngineCore.step measures each step
        out = step(scheduler)
        num_batch = batch_tokens(out)
        allowance.observe(out.total_num_scheduled_tokens, num_batch, 0.002 + 0.0004 * out.total_num_scheduled_tokens)
        return out

    add(scheduler, *(make_request(f"b{i}", "batch") for i in range(8)))
    add(scheduler, *(make_request(f"d{i}", "default", max_tokens=10) for i in range(4)))
    # The interactive prefills run alone: their first tokens come as fast as without the batch.
    assert scheduled(measured_step(scheduler)) == [(f"d{i}", 5) for i in range(4)]
    decodes = [measured_step(scheduler) for _ in range(8)]
    assert all(scheduled(out)[:4] == [(f"d{i}", 1) for i in range(4)] for out in decodes)
    granted = [batch_tokens(out) for out in decodes]
    assert set(granted) == {2, 3} and sum(granted) in (17, 18)
    while any(request.request_id.startswith("d") for request in scheduler.running):
        step(scheduler)
    # Nothing better running, but lately: batch steps the size of theirs (4 tokens), 25% more.
    assert 4 <= batch_tokens(step(scheduler)) <= 8
    clock.now += 5
    assert batch_tokens(step(scheduler)) > 8  # none lately: the batch takes the whole step


def test_without_a_bound_the_batch_fills_the_step():
    scheduler = make_scheduler(None)
    add(scheduler, *(make_request(f"b{i}", "batch") for i in range(8)))
    add(scheduler, *(make_request(f"d{i}", "default") for i in range(4)))
    assert batch_tokens(step(scheduler)) == 40


def test_the_engine_config_takes_a_bound_or_none():
    assert EngineConfig().batch_slowdown == 0.25 and EngineConfig(batch_slowdown=None).batch_slowdown is None
    with pytest.raises(ValueError, match="batch_slowdown"):
        EngineConfig(batch_slowdown=-1)


def test_the_plane_tells_what_a_batch_token_costs_apart_from_an_interactive_one():
    cost = StepCost()
    for _ in range(20):
        for interactive in (1, 4, 9, 16):
            for batch in (0, 2, 5, 11):
                cost.observe(interactive + batch, 0.002 + 0.0004 * interactive + 0.0008 * batch, batch)
    fixed, per_interactive, per_batch = cost.plane()
    assert (fixed, per_interactive, per_batch) == pytest.approx((0.002, 0.0004, 0.0008))
    # Four interactive tokens cost 3.6 ms; 25% of it, 0.9 ms, buys 1.125 batch tokens of 0.8 ms.
    allowance = BatchAllowance(0.25, cost, Clock())
    assert allowance.tokens(4) == 1
    # Batch tokens that never vary: no plane, the line on all tokens stands in.
    alone = StepCost()
    for interactive in (1, 4, 9, 16):
        alone.observe(interactive + 2, 0.002 + 0.0004 * interactive + 0.0018, 2)
    assert alone.plane() is None and alone.line() is not None
