"""A request better than the batch class that arrives while a step carries batch work runs a step
of its own between two of that step's layers (EngineCore.step's interjection,
Scheduler.schedule_interjection): its first token does not wait for the batch's step to end.
Asserted on the scheduler's choices (a real KVCacheManager, no model), then on the real engine:
the interjected step publishes the first tokens in the middle of the batch's step, and every
request's greedy tokens are those it gets alone."""

from __future__ import annotations

import os
import select

import pytest

from tests.engine.test_priority import BLOCK, add, make_request, make_scheduler, scheduled
from tokenway import LLM
from tokenway.engine.core import EngineCore
from tokenway.engine.scheduler import Scheduler, SchedulerOutput
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.protocol.job import ServiceClass
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams


def finish_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    sampled = [5] * len(out.sampling_requests)
    scheduler.update_from_output(out, sampled, [None] * len(sampled))


def test_only_better_classes_join_in_free_blocks_and_the_step_in_flight_is_untouched():
    scheduler = make_scheduler()
    add(scheduler, *(make_request(f"b{i}", "batch") for i in range(3)))
    in_flight = scheduler.schedule()
    add(scheduler, make_request("f0", "flex"), make_request("b3", "batch"), make_request("d0", "default"))
    tables = {r.request_id: list(t) for r, t in zip(in_flight.requests, in_flight.block_tables)}
    interjected = scheduler.schedule_interjection(in_flight)
    # Better classes first, each in its order; the batch request waits for the next step.
    assert scheduled(interjected) == [("d0", 5), ("f0", 5)]
    assert [r.request_id for r in scheduler.waiting] == ["b3"]
    # The step in flight keeps its requests, their counts and their blocks; none is shared.
    assert all(r.num_computed_tokens == 0 for r in in_flight.requests)
    assert {r.request_id: list(t) for r, t in zip(in_flight.requests, in_flight.block_tables)} == tables
    assert not in_flight.blocks_written(BLOCK) & interjected.blocks_written(BLOCK)
    # running stays ordered by class: the newcomers before the batch.
    assert [r.request_id for r in scheduler.running] == ["d0", "f0", "b0", "b1", "b2"]
    finish_step(scheduler, interjected)
    finish_step(scheduler, in_flight)
    assert scheduled(scheduler.schedule()) == [("d0", 1), ("f0", 1), ("b0", 1), ("b1", 1), ("b2", 1), ("b3", 5)]


def test_nothing_is_preempted_and_what_does_not_fit_waits_for_the_next_step():
    # 8 blocks: the batch holds 6 of them; the interactive prompt needs 3.
    scheduler = make_scheduler(num_blocks=8)
    add(scheduler, *(make_request(f"b{i}", "batch") for i in range(3)))
    in_flight = scheduler.schedule()
    add(scheduler, make_request("d0", "default", num_prompt_tokens=9), make_request("d1", "default"))
    interjected = scheduler.schedule_interjection(in_flight)
    assert interjected.requests == [] and not interjected.preempted_request_ids
    assert [r.request_id for r in scheduler.waiting] == ["d0", "d1"]  # d1 never passes d0
    finish_step(scheduler, in_flight)
    out = scheduler.schedule()  # the step after: d0 takes a batch request's blocks, as it always did
    assert scheduled(out)[0] == ("d0", 9) and out.preempted_request_ids


def test_max_num_seqs_holds_without_preemption():
    scheduler = make_scheduler(max_num_seqs=3)
    add(scheduler, *(make_request(f"b{i}", "batch") for i in range(3)))
    in_flight = scheduler.schedule()
    add(scheduler, make_request("p0", "priority"))
    assert scheduler.schedule_interjection(in_flight).requests == []
    assert len(scheduler.running) == 3


def test_a_cache_hit_on_a_block_the_step_in_flight_writes_waits_for_it():
    scheduler = make_scheduler()
    shared = list(range(500, 509))  # two whole blocks and one token
    batch = make_request("b0", "batch", max_tokens=4)
    batch.prompt_token_ids[:] = batch.all_token_ids[:] = shared
    add(scheduler, batch)
    in_flight = scheduler.schedule()  # writes the two blocks the next request would hit
    twin = make_request("d0", "default")
    twin.prompt_token_ids[:] = twin.all_token_ids[:] = shared + [7]
    add(scheduler, twin)
    assert scheduler.schedule_interjection(in_flight).requests == []
    finish_step(scheduler, in_flight)
    # Once written, the hit is taken: the interjection admits it with its cached blocks.
    nxt = scheduler.schedule()
    assert ("d0", 2) in scheduled(nxt) and twin.num_cached_tokens == 8


# -- the real engine ------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class PipeArrivals:
    """Arrivals as the engine process has them: requests queued here are taken in once the
    pipe's byte is read, at the first layer boundary after wake()."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.wake_fd, self._write_fd = os.pipe()
        self.queued: list[tuple[str, list[int], ServiceClass]] = []
        self.published: list[list[EngineOutput]] = []

    def wake(self, *requests: tuple[str, list[int], ServiceClass]) -> None:
        self.queued += requests
        os.write(self._write_fd, b"x")

    def take(self) -> bool:
        if not select.select([self.wake_fd], [], [], 0)[0]:
            return False
        os.read(self.wake_fd, 1)
        for request_id, prompt, service_class in self.queued:
            self.core.add_request(request_id, prompt, GREEDY, service_class)
        added, self.queued = bool(self.queued), []
        return added

    def publish(self, outputs: list[EngineOutput]) -> None:
        self.published.append(outputs)

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._write_fd)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    """The default model as it serves (GGUF blocks: decode steps run the native layer stack)."""
    return LLM(str(default_model_dir), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
               kv_cache_memory="64MiB", show_progress=False)


def test_an_interactive_request_gets_its_first_token_in_the_middle_of_a_batch_step(llm):
    core = llm.engine
    prompts = [core.tokenizer.encode(f"Tell me about the number {i}.", add_special_tokens=False) for i in range(6)]
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}

    def keep(outputs: list[EngineOutput]) -> None:
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids

    arrivals = PipeArrivals(core)
    try:
        for i in range(4):
            core.add_request(f"r{i}", prompts[i], GREEDY, "batch")
        keep(core.step(arrivals))  # their prompts (nothing arrived: no interjection)
        assert arrivals.published == [] and core.num_interjected_steps == 0
        # A decode step of the batch; an interactive request and a flex one arrive during it.
        arrivals.wake(("r4", prompts[4], "default"), ("r5", prompts[5], "flex"))
        own = core.step(arrivals)
        keep(own)
        assert core.num_interjected_steps == 1
        # Their first tokens were published while the batch's step ran, before its own outputs.
        assert [[(o.request_id, len(o.new_token_ids)) for o in outputs] for outputs in arrivals.published] == [
            [("r4", 1), ("r5", 1)]]
        assert sorted(o.request_id for o in own) == ["r0", "r1", "r2", "r3"]
        for outputs in arrivals.published:
            keep(outputs)
        while core.has_unfinished_requests():
            keep(core.step(arrivals))
    finally:
        arrivals.close()
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert [tokens[f"r{i}"] for i in range(6)] == alone


def test_a_step_without_batch_work_is_never_interjected(llm):
    core = llm.engine
    prompt = core.tokenizer.encode("Hello there.", add_special_tokens=False)
    arrivals = PipeArrivals(core)
    before = core.num_interjected_steps
    try:
        core.add_request("i0", prompt, GREEDY, "default")
        core.step(arrivals)
        arrivals.wake(("i1", prompt, "priority"))
        core.step(arrivals)  # i0's decode: i1 waits for the next step, as it always did
        assert arrivals.published == [] and core.num_interjected_steps == before
        while core.has_unfinished_requests():
            core.step(arrivals)
    finally:
        arrivals.close()


def test_the_batch_leaves_seats_for_better_classes_to_join_mid_step():
    scheduler = Scheduler(KVCacheManager(64, BLOCK), max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
                          max_num_batch_seqs=3)
    add(scheduler, *(make_request(f"b{i}", "batch") for i in range(5)))
    in_flight = scheduler.schedule()
    assert [r.request_id for r in in_flight.requests] == ["b0", "b1", "b2"]  # the 4th seat stays free
    add(scheduler, make_request("d0", "default"))
    assert scheduled(scheduler.schedule_interjection(in_flight)) == [("d0", 5)]
    finish_step(scheduler, in_flight)
    # Full now; the next arrival takes a batch request's seat in the next step, as before.
    add(scheduler, make_request("d1", "default"))
    out = scheduler.schedule()
    assert ("d1", 5) in scheduled(out) and out.preempted_request_ids == ["b2"]
