"""KV cache groups: a full-attention group and a sliding-window group (window 32, blocks of 16)
moving together in one KVCacheManager, and how plan_groups splits the memory between them."""

import random
import subprocess
import sys

import pytest

from tokenway.engine.request import Request
from tokenway.kv_cache.interface import KVCacheGroupSpec, plan_groups
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.protocol.sampling import SamplingParams

WINDOW = 32
BLOCK = 16


def make_request(request_id: str, prompt_token_ids) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(temperature=0))


def two_groups(num_full: int = 20, num_sliding: int = 10) -> KVCacheManager:
    return KVCacheManager(block_size=BLOCK, groups=[KVCacheGroupSpec(num_full),
                                                    KVCacheGroupSpec(num_sliding, window=WINDOW)])


def prefill(manager: KVCacheManager, request: Request) -> list[int] | None:
    hit_block_ids, num_hit_tokens = manager.get_computed_blocks(request)
    new_block_ids = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_block_ids)
    if new_block_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return new_block_ids


def decode(manager: KVCacheManager, request: Request, token_id: int = 7) -> list[int] | None:
    """One decode step: the token sampled last step gets its slot."""
    request.append_output_token_ids(token_id)
    new_block_ids = manager.allocate_slots(request, 1)
    if new_block_ids is not None:
        request.num_computed_tokens += 1
    return new_block_ids


def state(manager: KVCacheManager) -> list:
    """Everything allocate_slots could change, per group."""
    out = []
    for group in manager.groups:
        pool = group.block_pool
        out.append((pool.free_block_ids, [pool.ref_cnt(b) for b in range(pool.num_blocks)],
                    [pool.block_hash(b) for b in range(pool.num_blocks)],
                    {rid: list(ids) for rid, ids in group._request_id_to_block_ids.items()}))
    return out


def test_the_sliding_group_gives_back_blocks_behind_the_window_the_full_group_keeps_all():
    manager = two_groups()
    full, sliding = manager.groups
    null = sliding.null_block
    assert (full.null_block, null) == (None, 0) and sliding.num_blocks == 9
    request = make_request("a", range(40))
    assert prefill(manager, request) == [0, 1, 2] + [1, 2, 3]
    assert manager.get_block_tables("a") == ([0, 1, 2], [1, 2, 3])
    for _ in range(7):  # queries at positions 40..46 still see key 15 (block 0)
        assert decode(manager, request) == []
    assert manager.get_block_tables("a") == ([0, 1, 2], [1, 2, 3])
    # The query at 47 sees keys 16..47: block 0 is behind the window of it and every later query.
    assert decode(manager, request) == []
    assert manager.get_block_tables("a") == ([0, 1, 2], [null, 2, 3])
    assert sliding.block_pool.free_block_ids == [4, 5, 6, 7, 8, 9, 1] and sliding.num_free_blocks == 7
    assert full.num_free_blocks == 17
    assert decode(manager, request) == [3, 4]  # position 48 opens block 3 in both groups
    for _ in range(15):
        decode(manager, request)
    assert manager.get_block_tables("a") == ([0, 1, 2, 3], [null, null, 3, 4])  # query at 63: keys 32..63
    # Given back blocks stay cached (free, evictable): a prompt ending after block 1 hits them.
    assert sliding.block_pool.block_hash(2) == request.block_hashes[1]
    # Finishing (or preemption) gives back every block of every group; the null block stays out.
    manager.free(request)
    assert (full.num_free_blocks, sliding.num_free_blocks) == (20, 9)
    assert manager.num_free_blocks == manager.num_blocks and null not in sliding.block_pool.free_block_ids
    manager.free(request)  # idempotent
    assert sliding.block_pool.ref_cnt(null) == 1 and manager.reset_prefix_cache()


@pytest.mark.parametrize("short", ["full", "sliding"])
def test_allocation_is_all_or_nothing_across_groups(short):
    # Room for one 40-token request in the short group, plenty in the other.
    manager = two_groups(num_full=3 if short == "full" else 20, num_sliding=4 if short == "sliding" else 10)
    a = make_request("a", range(40))
    prefill(manager, a)
    before = state(manager)
    b = make_request("b", range(100, 120))
    assert prefill(manager, b) is None
    assert state(manager) == before and manager.get_block_tables("b") == ([], [])
    assert manager.num_free_blocks == 0 and manager.usage == 1.0  # as the group that ran out has it
    # A step that would give back a sliding block but cannot get its full block changes nothing either.
    for _ in range(8):
        decode(manager, a)  # positions 40..47: blocks 0-2 suffice, block 0 slides out at 47
    if short == "full":
        before = state(manager)
        num_computed = a.num_computed_tokens
        a.append_output_token_ids(7)
        assert manager.allocate_slots(a, 1) is None  # position 48 needs a fourth full block
        assert state(manager) == before and a.num_computed_tokens == num_computed
    else:  # the block given back at 47 is the one position 48 takes
        assert manager.get_block_tables("a")[1][0] == manager.null_block
        assert decode(manager, a) == [3, 1]


def test_a_hit_needs_every_full_block_and_the_sliding_blocks_in_the_window():
    manager = two_groups(num_full=20, num_sliding=10)
    full, sliding = manager.groups
    null = sliding.null_block
    a = make_request("a", range(100))  # blocks 0-5 full, 6 partial
    prefill(manager, a)
    assert manager.get_block_tables("a") == ([0, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7])
    manager.free(a)

    # 96 shared tokens: the full group hits all 6 blocks, the sliding group blocks 4-5 (keys 65..96 of
    # the query at 96); the blocks before them are neither needed nor taken.
    b = make_request("b", list(range(96)) + [500] * 10)
    assert manager.get_computed_blocks(b) == ([0, 1, 2, 3, 4, 5] + [null] * 4 + [5, 6], 96)
    assert manager.get_cache_miss_reason("b") == "hit"

    # Another prompt takes sliding blocks 8, 9, then 7 and 6 (a's blocks 6 and 5, freed first) from
    # the head of the free queue: the hit ends where the window still has its two blocks, after block 4.
    c = make_request("c", range(1000, 1064))
    prefill(manager, c)
    assert manager.get_block_tables("c")[1] == [8, 9, 7, 6]
    d = make_request("d", list(range(96)) + [600] * 10)
    hit_block_ids, num_hit_tokens = manager.get_computed_blocks(d)
    assert (hit_block_ids, num_hit_tokens) == ([0, 1, 2, 3, 4] + [null] * 3 + [4, 5], 80)
    assert manager.get_cache_miss_reason("d") == "evicted"
    assert manager.allocate_slots(d, 26, hit_block_ids) == [11, 12] + [3, 2]
    assert manager.get_block_tables("d") == ([0, 1, 2, 3, 4, 11, 12], [null] * 3 + [4, 5, 3, 2])
    # Only the blocks in the window were taken: a's blocks 0-2 (ids 1-3) are free, or evicted for d.
    assert [sliding.block_pool.ref_cnt(b) for b in (1, 4, 5)] == [0, 1, 1]
    assert [full.block_pool.ref_cnt(b) for b in range(5)] == [1] * 5
    manager.free(c)
    manager.free(d)

    # Within the first window a query reads every block from 0: a's block 1 (id 2) went to d, so a
    # prompt sharing a's first two blocks hits the first only.
    e = make_request("e", list(range(33)) + [700] * 7)
    assert manager.get_computed_blocks(e) == ([0] + [1], 16)
    assert manager.get_cache_miss_reason("e") == "evicted"


def test_without_prefix_caching_nothing_is_hit_and_blocks_still_slide():
    manager = KVCacheManager(block_size=BLOCK, enable_prefix_caching=False,
                             groups=[KVCacheGroupSpec(8), KVCacheGroupSpec(4, window=WINDOW)])
    a = make_request("a", range(40))
    prefill(manager, a)
    for _ in range(8):
        decode(manager, a)
    assert manager.get_block_tables("a") == ([0, 1, 2], [0, 2, 3])
    assert manager.get_computed_blocks(make_request("b", range(40))) == ([], 0)
    assert manager.get_cache_miss_reason("b") == "disabled"


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_keep_each_group_consistent(seed):
    """Requests come, run in random chunks, decode, are preempted and finish over two small groups.
    Each group's ref counts equal its tables' holders, the null block is never handed out, and every
    block a query could read (a hit or a table entry inside the window) holds the request's tokens."""
    rng = random.Random(seed)
    block, window = 4, 6
    manager = KVCacheManager(block_size=block, groups=[KVCacheGroupSpec(14), KVCacheGroupSpec(8, window=window)])
    full, sliding = manager.groups
    null = sliding.null_block
    # What the runner would have written into each block of each group.
    contents = [[[None] * block for _ in range(group.block_pool.num_blocks)] for group in manager.groups]
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(14))] for _ in range(3)]
    waiting: list[Request] = []
    running: list[Request] = []

    def check_readable(request: Request, num_computed: int) -> None:
        for group, tables, held in zip(manager.groups, manager.get_block_tables(request.request_id), contents):
            first = group.num_skipped_blocks(num_computed)
            assert all(block_id == group.null_block for block_id in tables[:first])
            for index in range(first, num_computed // block):
                assert held[tables[index]] == request.all_token_ids[index * block:(index + 1) * block]

    def run(request: Request, num_new: int, hit_block_ids: list[int]) -> bool:
        before = state(manager)
        new_block_ids = manager.allocate_slots(request, num_new, hit_block_ids)
        if new_block_ids is None:
            assert state(manager) == before
            return False
        num_new_full = (len(full.get_block_ids(request.request_id)) - len(before[0][3].get(request.request_id, []))
                        - len(hit_block_ids) // 2)
        assert null not in new_block_ids[num_new_full:]  # the sliding group's new blocks
        start = request.num_computed_tokens + len(hit_block_ids) // 2 * block
        check_readable(request, start)
        for tables, held in zip(manager.get_block_tables(request.request_id), contents):
            for position in range(start, start + num_new):
                held[tables[position // block]][position % block] = request.all_token_ids[position]
        request.num_computed_tokens = start + num_new
        return True

    for step in range(300):
        action = rng.random()
        if action < 0.2:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
            waiting.append(make_request(f"{step}", prompt))
        elif action < 0.45 and waiting:
            request = waiting[0]
            hit_block_ids, num_hit = manager.get_computed_blocks(request)
            if run(request, rng.randint(1, request.num_tokens - num_hit), hit_block_ids):
                running.append(waiting.pop(0))
        elif action < 0.9 and running:
            request = rng.choice(running)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(rng.randrange(3))
            if not run(request, rng.randint(1, request.num_tokens - request.num_computed_tokens), []):
                running.remove(request)  # preempted: every group's blocks go back
                manager.free(request)
                assert manager.get_block_tables(request.request_id) == ([], [])
                request.num_computed_tokens = 0
                waiting.insert(0, request)
        elif running:
            manager.free(running.pop(rng.randrange(len(running))))
        for group in manager.groups:
            holders = [0] * group.block_pool.num_blocks
            for request in running:
                for block_id in group.get_block_ids(request.request_id):
                    if block_id != group.null_block:
                        holders[block_id] += 1
            if group.null_block is not None:
                holders[group.null_block] = 1
                assert group.null_block not in group.block_pool.free_block_ids
            assert [group.block_pool.ref_cnt(b) for b in range(group.block_pool.num_blocks)] == holders

    for request in running + waiting:
        manager.free(request)
    assert (full.num_free_blocks, sliding.num_free_blocks) == (14, 7)
    assert manager.num_hit_tokens > 0 and sliding.block_pool.num_evicted_blocks > 0


def test_plan_groups_gives_the_sliding_layers_what_max_num_seqs_windows_need():
    # Gemma 3 270M's shape: 15 sliding layers (window 512) and 3 global ones, 16 KiB a layer-block.
    windows = ([512] * 5 + [None]) * 3
    plan = plan_groups(2 * 2**30, 16 * 2**10, windows, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=512, max_model_len=32768)
    sliding_blocks = 16 * (32 + 2) + 32 + 1  # 16 windows, a step's new tokens, the null block
    full_blocks = (2 * 2**30 - sliding_blocks * 15 * 16 * 2**10) // (3 * 16 * 2**10)
    assert plan == (KVCacheGroupSpec(full_blocks, None, 3), KVCacheGroupSpec(sliding_blocks, 512, 15))
    assert full_blocks > 2 * 2**30 // (18 * 16 * 2**10) * 5  # 5x the tokens one pool for every layer holds
    # A budget that cannot hold max_num_seqs windows keeps one pool for every layer, as before groups.
    one_pool = 2**30 // (18 * 16 * 2**10)
    assert plan_groups(2**30, 16 * 2**10, windows, 16, 128, 512, 32768) == (KVCacheGroupSpec(one_pool, None, 18),)
    # No query past the window: nothing to give back.
    assert plan_groups(2**30, 16 * 2**10, windows, 16, 16, 512, 512) == (KVCacheGroupSpec(one_pool, None, 18),)
    # Every layer slides, or none does: one group.
    assert plan_groups(2**30, 2**10, [64] * 4, 16, 8, 64, 4096) == (KVCacheGroupSpec(2**18, 64, 4),)
    assert plan_groups(2**30, 2**10, [None] * 4, 16, 8, 64, 4096) == (KVCacheGroupSpec(2**18, None, 4),)
    with pytest.raises(ValueError, match="different windows"):
        plan_groups(2**30, 2**10, [64, 128, None], 16, 8, 64, 4096)


def test_group_specs_are_checked():
    with pytest.raises(ValueError):
        KVCacheGroupSpec(0)
    with pytest.raises(ValueError):
        KVCacheGroupSpec(1, window=8)  # no room beside the null block
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, groups=[KVCacheGroupSpec(4)])
    with pytest.raises(ValueError):
        KVCacheManager()


def test_the_kv_cache_does_not_import_the_engine():
    code = "import sys, tokenway.kv_cache.manager; print(any(m.startswith('tokenway.engine') for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
