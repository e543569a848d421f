"""Service classes in the scheduler (engine/scheduler.py): a better class is admitted first and
takes the step's token budget first; when the KV cache or max_num_seqs stops it, running requests
of a worse class are preempted, the worst class and the newest first; within a class, first come
first served. Asserted on the scheduler's order, step by step (a real KVCacheManager, no model),
then on the real engine: its counts per class, and outputs that preemption leaves unchanged."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tokenway import LLM
from tokenway.engine.client import AsyncEngine
from tokenway.engine.request import Request, RequestStatus
from tokenway.engine.scheduler import Scheduler, SchedulerOutput
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.observability.metrics import EngineCollector
from tokenway.protocol.job import ServiceClass
from tokenway.protocol.outputs import EngineOutput
from tokenway.protocol.sampling import SamplingParams

BLOCK = 4
SAMPLED = 5
_tokens = itertools.count(1000)  # every prompt its own tokens: no prefix-cache hit unless a test wants one


def make_request(request_id: str, service_class: ServiceClass, num_prompt_tokens: int = 5,
                 max_tokens: int = 20) -> Request:
    prompt = [next(_tokens) for _ in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                   service_class=service_class)


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK), max_model_len=256, max_num_batched_tokens=budget,
                     max_num_seqs=max_num_seqs)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = [SAMPLED] * len(out.sampling_requests)
    scheduler.update_from_output(out, sampled, [None] * len(sampled))
    return out


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(request.request_id, n) for request, n in zip(out.requests, out.num_scheduled_tokens)]


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def test_interactive_requests_arriving_while_a_large_batch_runs_are_admitted_in_the_next_step():
    scheduler = make_scheduler(max_num_seqs=8)
    batch = [make_request(f"b{i}", "batch") for i in range(12)]
    add(scheduler, *batch)
    assert scheduled(step(scheduler)) == [(f"b{i}", 5) for i in range(8)]  # max_num_seqs: 4 wait
    assert scheduled(step(scheduler)) == [(f"b{i}", 1) for i in range(8)]
    add(scheduler, make_request("d0", "default"), make_request("p0", "priority"), make_request("d1", "default"))
    out = step(scheduler)
    # The best class first, each first come first served; the newest batch requests make room.
    assert scheduled(out)[:3] == [("p0", 5), ("d0", 5), ("d1", 5)]
    assert scheduled(out)[3:] == [(f"b{i}", 1) for i in range(5)]
    assert out.preempted_request_ids == ["b7", "b6", "b5"]
    # Preempted batch requests resume first within their class, oldest first, ahead of b8..b11.
    assert [r.request_id for r in scheduler.waiting] == ["b5", "b6", "b7", "b8", "b9", "b10", "b11"]
    assert [r.request_id for r in scheduler.running] == ["p0", "d0", "d1", "b0", "b1", "b2", "b3", "b4"]
    assert scheduler.num_preemptions_by_rank == [0, 0, 0, 3] and scheduler.num_preemptions == 3
    assert scheduler.num_prompt_tokens_by_rank == [5, 10, 0, 40]  # b5-b7 are not counted again when they resume
    # No batch request is admitted while interactive ones fill the seats.
    assert scheduled(step(scheduler)) == [("p0", 1), ("d0", 1), ("d1", 1)] + [(f"b{i}", 1) for i in range(5)]


def test_running_out_of_blocks_preempts_the_worst_class_newest_first_never_a_better_one():
    # d0, f0, b0, b1: 5-token prompts, 2 blocks each: 8 of 10 blocks.
    scheduler = make_scheduler(num_blocks=10)
    kv = scheduler.kv_manager
    add(scheduler, make_request("d0", "default"), make_request("f0", "flex"), make_request("b0", "batch"),
        make_request("b1", "batch"))
    step(scheduler)
    assert kv.num_free_blocks == 2
    add(scheduler, make_request("p0", "priority", num_prompt_tokens=20))  # 5 blocks
    out = step(scheduler)
    assert out.preempted_request_ids == ["b1", "b0"]  # 2 + 2 freed blocks are enough: f0 keeps its own
    assert scheduled(out) == [("p0", 20), ("d0", 1), ("f0", 1)]
    assert [r.status for r in scheduler.waiting] == [RequestStatus.PREEMPTED] * 2
    assert kv.num_free_blocks == 1 and scheduler.num_preemptions_by_rank == [0, 0, 0, 2]


def test_a_request_never_preempts_its_own_class_or_a_better_one_it_waits_as_under_fcfs():
    scheduler = make_scheduler(num_blocks=6)
    add(scheduler, make_request("d0", "default"), make_request("f0", "flex"), make_request("b0", "batch"))
    step(scheduler)
    add(scheduler, make_request("d1", "default", num_prompt_tokens=7), make_request("b1", "batch"))
    out = step(scheduler)  # d1 needs 2 blocks, none is free: only b0 is worse, and it goes
    assert out.preempted_request_ids == ["b0"] and scheduled(out) == [("d0", 1), ("d1", 7), ("f0", 1)]
    add(scheduler, make_request("f1", "flex", num_prompt_tokens=8))
    out = step(scheduler)  # only f0 and better run: f1 waits, and so does every batch request behind it
    assert out.preempted_request_ids == [] and scheduled(out) == [("d0", 1), ("d1", 1), ("f0", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["f1", "b0", "b1"]


def test_the_token_budget_goes_to_the_better_class_first():
    scheduler = make_scheduler(budget=16)
    add(scheduler, make_request("b0", "batch", num_prompt_tokens=64))
    assert scheduled(step(scheduler)) == [("b0", 16)]  # a long prompt: 16-token chunks
    add(scheduler, make_request("d0", "default", num_prompt_tokens=10))
    assert scheduled(step(scheduler)) == [("d0", 10), ("b0", 6)]  # the chunk takes what d0 leaves
    assert scheduled(step(scheduler)) == [("d0", 1), ("b0", 15)]
    # All of one class, the running request's chunk comes first, as it always did.
    same = make_scheduler(budget=16)
    add(same, make_request("b0", "batch", num_prompt_tokens=64))
    step(same)
    add(same, make_request("b1", "batch", num_prompt_tokens=10))
    assert scheduled(step(same)) == [("b0", 16)]


def test_first_come_first_served_within_a_class_and_counts_per_class():
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, *(make_request(name, "batch" if name[0] == "b" else "flex", max_tokens=2)
                     for name in ("b0", "f0", "b1", "f1", "f2")))
    order = []
    while scheduler.num_unfinished_requests:
        order += [name for name, num_new in scheduled(step(scheduler)) if num_new > 1]
    assert order == ["f0", "f1", "f2", "b0", "b1"]
    assert scheduler.num_generated_tokens_by_rank == [0, 0, 6, 4]
    assert scheduler.num_prompt_tokens_by_rank == [0, 0, 15, 10] and scheduler.num_preemptions == 0


def test_an_unknown_class_is_refused_by_name():
    with pytest.raises(ValueError, match="service_class: expected one of priority, default, flex, batch"):
        make_request("x", "gold")  # type: ignore[arg-type]


# -- the real engine ------------------------------------------------------------------------------

QUESTION = "Why is the sky blue? Explain it in simple words"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def small(default_model_dir):
    """Four sequences at most: interactive calls must take seats from the batch (no slowdown
    bound, so the batch may hold every seat: tests/engine/test_interjection.py has the seat it leaves)."""
    return LLM(str(default_model_dir), dtype="float32", quantization="none", kv_cache_memory="32MiB",
               max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128, batch_slowdown=None,
               show_progress=False)


def test_the_engine_admits_interactive_requests_within_one_step_and_outputs_stay_the_same(small):
    core = small.engine
    prompts = [core.tokenizer.encode(f"{QUESTION} ({i})", add_special_tokens=False) for i in range(8)]
    names = ["b0", "b1", "b2", "b3", "b4", "b5", "p0", "d0"]
    tokens: dict[str, list[int]] = {name: [] for name in names}

    def step() -> dict[str, EngineOutput]:
        outputs = {output.request_id: output for output in core.step()}
        for name, output in outputs.items():
            tokens[name] += output.new_token_ids
        return outputs

    for name, prompt in zip(names[:6], prompts):
        core.add_request(name, prompt, GREEDY, "batch")
    while len(core.scheduler.running) < 4 or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        step()
    core.add_request("p0", prompts[6], GREEDY, "priority")
    core.add_request("d0", prompts[7], GREEDY, "default")
    outputs = step()
    # Both took a seat in this step and sampled their first token.
    assert len(outputs["p0"].new_token_ids) == len(outputs["d0"].new_token_ids) == 1
    stats = core.snapshot()
    assert stats.classes is not None
    assert [(c.service_class, c.num_running, c.num_waiting, c.num_preemptions) for c in stats.classes] == [
        ("priority", 1, 0, 0), ("default", 1, 0, 0), ("flex", 0, 0, 0), ("batch", 2, 4, 2)]
    assert stats.num_running == 4 and stats.num_waiting == 4 and stats.num_preemptions == 2
    while core.has_unfinished_requests():
        step()
    # Preempted requests resumed from the prefix cache: the same greedy tokens as each run alone.
    alone = [o.outputs[0].token_ids for o in small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert [tokens[name] for name in names] == alone
    batch = core.snapshot().of_class("batch")
    assert batch is not None and batch.num_prompt_tokens == sum(map(len, prompts[:6]))
    assert batch.num_generated_tokens == 6 * 12 and batch.num_running == batch.num_waiting == 0


def test_llm_and_the_async_engine_carry_the_class_to_the_engine(small):
    before = small.engine.snapshot()
    prompt = small.tokenizer.encode(QUESTION, add_special_tokens=False)
    small.generate([{"prompt_token_ids": prompt}] * 2, GREEDY, service_class=["flex", "priority"])
    engine = AsyncEngine(core=small.engine)
    try:
        _, last = asyncio.run(collect_class(engine, prompt, "batch"))
        assert last is not None and last.finished
        with pytest.raises(ValueError, match="service_class"):
            asyncio.run(collect_class(engine, prompt, "gold"))
    finally:
        engine.shutdown()
    after = small.engine.snapshot()
    generated = {c.service_class: c.num_generated_tokens - b.num_generated_tokens
                 for c, b in zip(after.classes, before.classes)}
    assert generated == {"priority": 12, "default": 0, "flex": 12, "batch": 12}
    with pytest.raises(ValueError, match="service_class: got 1 for 2 prompts"):
        small.generate([{"prompt_token_ids": prompt}] * 2, GREEDY, service_class=["flex"])


async def collect_class(engine, prompt, service_class):
    deltas, last = [], None
    async for output in engine.generate(prompt, GREEDY, service_class=service_class):
        deltas.append(output.outputs[0].delta_text)
        last = output
    return deltas, last


def test_metrics_show_the_counts_per_class_with_a_class_label(small):
    stats = small.engine.snapshot()
    families = {family.name: family for family in EngineCollector(lambda: stats).collect()}
    running = families["tokenway_class_requests_running"]
    assert running.type == "gauge" and [s.labels for s in running.samples] == [
        {"class": name} for name in ("priority", "default", "flex", "batch")]
    generated = families["tokenway_class_generated_tokens"]
    assert generated.type == "counter"
    assert {s.labels["class"]: s.value for s in generated.samples if s.name.endswith("_total")} == {
        c.service_class: c.num_generated_tokens for c in stats.classes or ()}
    assert {"tokenway_class_requests_waiting", "tokenway_class_preemptions",
            "tokenway_class_prompt_tokens"} <= set(families)
