"""The Scheduler with a real KVCacheManager and no model (vLLM's tests/v1/core/test_scheduler.py
style): each step is scheduled, then fed a made-up sampled token per sampling request. Blocks of 4
tokens; the token budget, max_num_seqs and the cache are small enough to bind."""

from __future__ import annotations

from tokenway.engine.request import Request, RequestStatus
from tokenway.engine.scheduler import Scheduler, SchedulerOutput
from tokenway.kv_cache.interface import KVCacheGroupSpec
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.protocol.sampling import SamplingParams

BLOCK = 4
SAMPLED = 5  # every sampled token (no EOS is set, so only max_tokens ends a request)


def make_request(request_id: str, prompt_token_ids, max_tokens: int = 4) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(temperature=0, max_tokens=max_tokens))


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8,
                   sliding: KVCacheGroupSpec | None = None) -> Scheduler:
    if sliding is None:
        kv = KVCacheManager(num_blocks, BLOCK)
    else:
        kv = KVCacheManager(block_size=BLOCK, groups=[KVCacheGroupSpec(num_blocks), sliding])
    return Scheduler(kv, max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = [SAMPLED] * len(out.sampling_requests)
    scheduler.update_from_output(out, sampled, [None] * len(sampled))
    return out


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(request.request_id, n) for request, n in zip(out.requests, out.num_scheduled_tokens)]


def test_chunked_prefill_fills_the_token_budget_running_requests_first():
    scheduler = make_scheduler(budget=16)
    a, b = make_request("a", range(40), max_tokens=3), make_request("b", range(100, 110), max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert scheduled(step(scheduler)) == [("a", 16)]  # a's first chunk takes the whole budget
    assert scheduled(step(scheduler)) == [("a", 16)]
    assert scheduled(step(scheduler)) == [("a", 8), ("b", 8)]  # a's last chunk samples; b starts
    assert (a.output_token_ids, b.output_token_ids) == ([SAMPLED], [])
    assert scheduled(step(scheduler)) == [("a", 1), ("b", 2)]  # a decode row, b's last chunk
    out = step(scheduler)
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH and scheduler.num_unfinished_requests == 0
    assert scheduler.kv_manager.num_free_blocks == 64


def test_max_num_seqs_bounds_the_running_requests_and_admission_is_first_come():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, range(8), max_tokens=2))
    assert scheduled(step(scheduler)) == [("a", 8), ("b", 4)]  # b hits a's first block (same prompt)
    assert scheduled(step(scheduler)) == [("a", 1), ("b", 1)]  # both finish; c still waits this step
    assert scheduled(step(scheduler)) == [("c", 4)]
    assert scheduled(step(scheduler)) == [("c", 1)]
    assert scheduler.num_unfinished_requests == 0


def test_prefix_cache_hits_across_requests():
    scheduler = make_scheduler()
    a = make_request("a", range(20), max_tokens=8)
    scheduler.add_request(a)
    step(scheduler)
    b = make_request("b", list(range(16)) + [90] * 6)
    scheduler.add_request(b)
    out = step(scheduler)
    assert scheduled(out) == [("a", 1), ("b", 6)]  # b's first 4 blocks (16 tokens) are a's
    assert (b.num_cached_tokens, b.cache_reason) == (16, "not_cached")
    assert out.block_tables[1][:4] == out.block_tables[0][:4] and out.block_tables[1][4] not in out.block_tables[0]
    assert out.sliding_block_tables == []


def test_the_newest_request_is_preempted_when_blocks_run_out_and_resumes_from_the_prefix_cache():
    scheduler = make_scheduler(num_blocks=6)
    kv = scheduler.kv_manager
    a, b = make_request("a", range(8), max_tokens=7), make_request("b", range(100, 108), max_tokens=20)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert scheduled(step(scheduler)) == [("a", 8), ("b", 8)]  # 2 blocks each
    for _ in range(4):  # positions 8..11: a third block each, the last free ones
        assert scheduled(step(scheduler)) == [("a", 1), ("b", 1)]
    assert kv.num_free_blocks == 0
    out = step(scheduler)  # position 12 needs a fourth block: b, the newest, gives its 3 back
    assert scheduled(out) == [("a", 1)] and out.preempted_request_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert list(scheduler.waiting) == [b] and kv.get_block_ids("b") == [] and kv.num_free_blocks == 2
    assert scheduled(step(scheduler)) == [("a", 1)]  # b needs 4 blocks: it waits; a finishes
    assert a.status == RequestStatus.FINISHED_LENGTH and kv.num_free_blocks == 6
    # b's first two blocks are still cached (a took the third): 8 of its 13 tokens are not recomputed.
    hits_before = kv.num_hit_tokens
    assert scheduled(step(scheduler)) == [("b", 5)]
    assert kv.num_hit_tokens - hits_before == 8 and b.output_token_ids == [SAMPLED] * 6
    assert scheduler.num_preemptions == 1


def test_a_sliding_group_gives_back_blocks_and_can_be_what_preempts():
    """A full group with room to spare and a sliding group (window 8: a query reads at most 3 blocks)
    of 5 blocks: two requests fit until both are 9 tokens long."""
    scheduler = make_scheduler(num_blocks=64, sliding=KVCacheGroupSpec(6, window=8))
    kv = scheduler.kv_manager
    full, sliding = kv.groups
    null = sliding.null_block
    a, b = make_request("a", range(4), max_tokens=12), make_request("b", range(100, 104), max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert scheduled(step(scheduler)) == [("a", 4), ("b", 4)]
    for _ in range(4):  # positions 4..7: a second block each
        out = step(scheduler)
        assert scheduled(out) == [("a", 1), ("b", 1)]
    assert out.sliding_block_tables == [[1, 3], [2, 4]] and out.block_tables == [[0, 2], [1, 3]]
    assert sliding.num_free_blocks == 1 and full.num_free_blocks == 60
    out = step(scheduler)  # position 8: a third block each, one free: b is preempted, full or not
    assert scheduled(out) == [("a", 1)] and out.preempted_request_ids == ["b"]
    assert full.num_free_blocks == 61 and sliding.num_free_blocks == 2 and kv.get_block_tables("b") == ([], [])
    # The figure reported is the first group's blocks at the usage of the group nearest to running out.
    assert kv.num_blocks == 64 and kv.num_free_blocks == 64 * 2 // 5 and kv.usage == sliding.usage == 0.6
    # b (9 tokens) hits its 2 blocks in both groups but needs a third: it waits while a runs alone...
    assert scheduled(step(scheduler)) == [("a", 1)]
    assert scheduled(step(scheduler)) == [("a", 1)]
    # ...until a's query at 11 no longer reads block 0: a gives it back, and b takes it.
    out = step(scheduler)
    assert scheduled(out) == [("a", 1), ("b", 1)] and kv.num_hit_tokens == 8
    assert out.sliding_block_tables == [[null, 3, 5], [2, 4, 1]]
    out = step(scheduler)  # position 12 opens a's next block: b, the newest, goes again
    assert scheduled(out) == [("a", 1)] and out.preempted_request_ids == ["b"]
    assert sliding.get_block_ids("a") == [null, 3, 5, 1] and b.num_preemptions == 2
    assert scheduled(step(scheduler)) == [("a", 1)]
    assert scheduled(step(scheduler)) == [("a", 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH and (full.num_free_blocks, sliding.num_free_blocks) == (64, 5)
    assert scheduled(step(scheduler)) == [("b", 2)] and kv.num_hit_tokens == 16  # 8 of its 10 tokens hit again
    while scheduler.num_unfinished_requests:
        step(scheduler)
    assert b.output_token_ids == [SAMPLED] * 12 and (full.num_free_blocks, sliding.num_free_blocks) == (64, 5)


def test_a_long_request_holds_its_window_in_the_sliding_group_only():
    scheduler = make_scheduler(num_blocks=64, budget=16, sliding=KVCacheGroupSpec(8, window=8))
    full, sliding = scheduler.kv_manager.groups
    request = make_request("a", range(40), max_tokens=20)
    scheduler.add_request(request)
    assert scheduled(step(scheduler)) == [("a", 16)]
    assert len(full.get_block_ids("a")) == 4 and sliding.num_free_blocks == 3  # the chunk's 4 blocks
    assert scheduled(step(scheduler)) == [("a", 16)]  # blocks 0-1 are behind the window of position 16
    assert sliding.get_block_ids("a")[:2] == [sliding.null_block] * 2 and sliding.num_free_blocks == 1
    while scheduler.num_unfinished_requests:
        held = [b for b in sliding.get_block_ids("a") if b != sliding.null_block]
        assert len(held) <= 6  # the window's 3 blocks and a 16-token chunk's 4, overlapping
        step(scheduler)
    assert full.num_free_blocks == 64 and sliding.num_free_blocks == 7
