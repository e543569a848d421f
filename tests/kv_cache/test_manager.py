import random

import pytest

from tokenway.engine.request import Request
from tokenway.kv_cache.block_hash import hash_block_tokens, update_block_hashes
from tokenway.kv_cache.manager import KVCacheManager
from tokenway.protocol.sampling import SamplingParams


def make_request(request_id: str, prompt_token_ids) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(temperature=0))


def prefill(manager: KVCacheManager, request: Request) -> tuple[list[int], list[int] | None]:
    """Schedule the whole prompt in one step, as the scheduler would; (hits, new blocks)."""
    computed_block_ids, num_computed_tokens = manager.get_computed_blocks(request)
    new_block_ids = manager.allocate_slots(request, request.num_tokens - num_computed_tokens, computed_block_ids)
    if new_block_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return computed_block_ids, new_block_ids


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [manager.block_pool.ref_cnt(block_id) for block_id in range(manager.num_blocks)]


def snapshot(manager: KVCacheManager, request_id: str):
    pool = manager.block_pool
    return (
        pool.free_block_ids,
        ref_cnts(manager),
        [pool.block_hash(block_id) for block_id in range(pool.num_blocks)],
        pool.num_evicted_blocks,
        list(manager.get_block_ids(request_id)),
    )


def test_block_hashes_chain_and_are_incremental():
    h0 = hash_block_tokens(None, [1, 2], "m")
    assert len(h0) == 16
    assert h0 == hash_block_tokens(None, [1, 2], "m")
    assert h0 != hash_block_tokens(None, [2, 1], "m")
    assert h0 != hash_block_tokens(None, [1, 2], "n")
    assert hash_block_tokens(h0, [3, 4], "m") != hash_block_tokens(None, [3, 4], "m")

    request = make_request("0", [1, 2, 3, 4, 5])
    update_block_hashes(request, 2, "m")
    assert request.block_hashes == [h0, hash_block_tokens(h0, [3, 4], "m")]
    request.append_output_token_ids(6)
    update_block_hashes(request, 2, "m")
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [5, 6], "m")
    assert len(request.block_hashes) == 3


def test_prefill_allocates_fresh_blocks_in_order_and_caches_full_ones():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    pool = manager.block_pool
    req0 = make_request("0", range(51))  # 3 full blocks + 3 tokens

    assert manager.get_computed_blocks(req0) == ([], 0)
    assert manager.get_cache_miss_reason("0") == "not_cached"
    assert manager.allocate_slots(req0, 51) == [0, 1, 2, 3]
    assert manager.get_block_ids("0") == [0, 1, 2, 3]
    assert len(req0.block_hashes) == 3
    assert [pool.get_cached_block(h) for h in req0.block_hashes] == [0, 1, 2]
    assert pool.block_hash(3) is None
    assert ref_cnts(manager)[:5] == [1, 1, 1, 1, 0]
    assert manager.num_free_blocks == 6
    assert manager.usage == pytest.approx(0.4)


def test_shared_prefix_reuses_exact_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    req0 = make_request("0", range(51))
    prefill(manager, req0)

    req1 = make_request("1", list(range(48)) + [100, 101, 102, 103, 104])
    computed_block_ids, num_computed_tokens = manager.get_computed_blocks(req1)
    assert (computed_block_ids, num_computed_tokens) == ([0, 1, 2], 48)
    assert manager.get_cache_miss_reason("1") == "hit"
    assert ref_cnts(manager)[:5] == [1, 1, 1, 1, 0]  # lookup takes no refs
    assert manager.allocate_slots(req1, 53 - 48, computed_block_ids) == [4]
    assert manager.get_block_ids("1") == [0, 1, 2, 4]
    assert ref_cnts(manager)[:6] == [2, 2, 2, 1, 1, 0]

    req2 = make_request("2", list(range(32)) + [200] * 20)
    assert manager.get_computed_blocks(req2) == ([0, 1], 32)
    assert manager.get_cache_miss_reason("2") == "not_cached"  # 2 blocks hit, then one never cached
    # A lookup counts once its allocation succeeds.
    assert manager.prefix_cache_hit_rate == pytest.approx((0 + 48) / (51 + 53))
    assert manager.allocate_slots(req2, 52 - 32, [0, 1]) == [5, 6]
    assert manager.prefix_cache_hit_rate == pytest.approx((0 + 48 + 32) / (51 + 53 + 52))


def test_full_hit_recomputes_the_last_block():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    pool = manager.block_pool
    req0 = make_request("0", range(32))
    assert prefill(manager, req0) == ([], [0, 1])
    assert [pool.get_cached_block(h) for h in req0.block_hashes] == [0, 1]

    req1 = make_request("1", range(32))
    computed_block_ids, num_computed_tokens = manager.get_computed_blocks(req1)
    assert (computed_block_ids, num_computed_tokens) == ([0], 16)
    assert manager.get_cache_miss_reason("1") == "hit"
    assert manager.allocate_slots(req1, 16, computed_block_ids) == [2]
    # Block 2 holds the same tokens as block 1, which keeps the hash.
    assert pool.get_cached_block(req1.block_hashes[1]) == 1
    assert pool.block_hash(2) is None
    assert ref_cnts(manager)[:4] == [2, 1, 1, 0]


@pytest.mark.parametrize("num_prompt_tokens", [10, 16])
def test_no_full_block_before_the_last_token(num_prompt_tokens):
    manager = KVCacheManager(num_blocks=4, block_size=16)
    prefill(manager, make_request("0", range(num_prompt_tokens)))
    assert manager.get_computed_blocks(make_request("1", range(num_prompt_tokens))) == ([], 0)
    assert manager.get_cache_miss_reason("1") == "no_full_block"


def test_free_releases_blocks_in_reverse_order_and_is_idempotent():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    req0 = make_request("0", range(51))
    req1 = make_request("1", range(1000, 1020))
    assert prefill(manager, req0) == ([], [0, 1, 2, 3])
    assert prefill(manager, req1) == ([], [4, 5])

    manager.free(req0)
    assert manager.block_pool.free_block_ids == [6, 7, 8, 9, 3, 2, 1, 0]
    assert manager.get_block_ids("0") == []
    assert manager.get_cache_miss_reason("0") is None
    manager.free(req0)
    assert manager.block_pool.free_block_ids == [6, 7, 8, 9, 3, 2, 1, 0]

    manager.free(req1)
    assert manager.block_pool.free_block_ids == [6, 7, 8, 9, 3, 2, 1, 0, 5, 4]
    assert manager.num_free_blocks == 10
    assert manager.usage == 0.0
    assert ref_cnts(manager) == [0] * 10


def test_lru_eviction_and_hits_on_free_cached_blocks():
    manager = KVCacheManager(num_blocks=6, block_size=16)
    pool = manager.block_pool
    req_a = make_request("a", range(33))
    req_b = make_request("b", range(1000, 1033))
    assert prefill(manager, req_a) == ([], [0, 1, 2])
    assert prefill(manager, req_b) == ([], [3, 4, 5])
    manager.free(req_a)
    manager.free(req_b)
    assert pool.free_block_ids == [2, 1, 0, 5, 4, 3]
    assert pool.num_cached_blocks == 4

    # A was freed first, so its blocks go first: 2 was never cached, 1 is evicted.
    req_c = make_request("c", range(2000, 2017))
    assert prefill(manager, req_c) == ([], [2, 1])
    assert pool.num_evicted_blocks == 1
    assert pool.get_cached_block(req_a.block_hashes[1]) is None
    assert pool.get_cached_block(req_a.block_hashes[0]) == 0
    assert pool.get_cached_block(req_c.block_hashes[0]) == 2  # C's first block
    assert pool.free_block_ids == [0, 5, 4, 3]

    # A hit on free cached blocks (4 sits mid-queue) takes them out of the queue
    # before the new block is taken from the head.
    req_d = make_request("d", list(range(1000, 1032)) + list(range(3000, 3008)))
    computed_block_ids, num_computed_tokens = manager.get_computed_blocks(req_d)
    assert (computed_block_ids, num_computed_tokens) == ([3, 4], 32)
    assert manager.allocate_slots(req_d, 8, computed_block_ids) == [0]
    assert manager.get_block_ids("d") == [3, 4, 0]
    assert pool.free_block_ids == [5]
    assert pool.num_evicted_blocks == 2
    assert pool.get_cached_block(req_a.block_hashes[0]) is None
    assert ref_cnts(manager) == [1, 1, 1, 1, 1, 0]


def test_hit_blocks_at_the_queue_head_are_not_handed_out_as_new():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    req_a = make_request("a", range(32))
    assert prefill(manager, req_a) == ([], [0, 1])
    req_y = make_request("y", range(1000, 1020))
    assert prefill(manager, req_y) == ([], [2, 3])
    manager.free(req_a)
    manager.free(req_y)
    assert manager.block_pool.free_block_ids == [1, 0, 3, 2]

    req_b = make_request("b", list(range(32)) + list(range(2000, 2008)))
    assert prefill(manager, req_b) == ([0, 1], [3])
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert manager.block_pool.free_block_ids == [2]


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    req_a = make_request("a", range(33))
    assert prefill(manager, req_a) == ([], [0, 1, 2])
    manager.free(req_a)
    assert manager.block_pool.free_block_ids == [3, 2, 1, 0]

    # 2 hits + 3 new blocks: 3 new would fit in 4 free blocks, but the hits are free too.
    req_b = make_request("b", list(range(32)) + list(range(1000, 1040)))
    computed_block_ids, num_computed_tokens = manager.get_computed_blocks(req_b)
    assert (computed_block_ids, num_computed_tokens) == ([0, 1], 32)
    before = snapshot(manager, "b")
    assert manager.allocate_slots(req_b, 40, computed_block_ids) is None
    assert snapshot(manager, "b") == before
    assert manager.get_cache_miss_reason("b") == "not_cached"

    # 2 hits + 2 new blocks fit exactly.
    req_c = make_request("c", list(range(32)) + list(range(1000, 1020)))
    assert prefill(manager, req_c) == ([0, 1], [3, 2])
    assert manager.num_free_blocks == 0

    # A decode step that needs a new block cannot get one.
    req_c.append_output_token_ids([7] * 12)
    assert manager.allocate_slots(req_c, 12) == []  # fills block 2 (tokens 48..63)
    req_c.num_computed_tokens += 12
    req_c.append_output_token_ids(8)
    before = snapshot(manager, "c")
    assert manager.allocate_slots(req_c, 1) is None
    assert snapshot(manager, "c") == before

    # req_b's failed lookups (two of them) never counted.
    manager.get_computed_blocks(req_b)
    assert manager.num_queried_tokens == 33 + 52
    assert manager.num_hit_tokens == 32


def test_chunked_prefill_caches_only_scheduled_full_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    pool = manager.block_pool
    req = make_request("0", range(40))
    assert manager.allocate_slots(req, 20) == [0, 1]
    assert pool.block_hash(0) == req.block_hashes[0]
    assert pool.block_hash(1) is None
    req.num_computed_tokens = 20
    assert manager.allocate_slots(req, 20) == [2]
    assert pool.block_hash(1) == req.block_hashes[1]
    assert pool.block_hash(2) is None


def test_decode_tokens_that_fill_a_block_get_it_cached():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    pool = manager.block_pool
    req = make_request("0", range(30))
    assert prefill(manager, req) == ([], [0, 1])
    assert len(req.block_hashes) == 1

    req.append_output_token_ids(500)
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    assert len(req.block_hashes) == 1
    assert pool.block_hash(1) is None

    req.append_output_token_ids(501)  # token 32 fills block 1
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    expected_hash = hash_block_tokens(req.block_hashes[0], list(range(16, 30)) + [500, 501], "")
    assert req.block_hashes[1] == expected_hash
    assert pool.get_cached_block(expected_hash) == 1

    req.append_output_token_ids(502)
    assert manager.allocate_slots(req, 1) == [2]
    assert manager.get_block_ids("0") == [0, 1, 2]

    # A prompt that continues the generated text hits the decoded block.
    follower = make_request("1", list(range(30)) + [500, 501, 9])
    assert manager.get_computed_blocks(follower) == ([0, 1], 32)


def test_namespaces_isolate_models():
    llama = KVCacheManager(num_blocks=10, block_size=16, namespace="llama")
    req0 = make_request("0", range(33))
    prefill(llama, req0)
    assert llama.get_computed_blocks(make_request("1", range(33))) == ([0, 1], 32)

    qwen_req = make_request("2", range(33))
    update_block_hashes(qwen_req, 16, "qwen")
    assert [llama.block_pool.get_cached_block(h) for h in qwen_req.block_hashes] == [None, None]


def test_prefix_caching_disabled():
    manager = KVCacheManager(num_blocks=10, block_size=16, enable_prefix_caching=False)
    req0 = make_request("0", range(33))
    req1 = make_request("1", range(33))
    assert prefill(manager, req0) == ([], [0, 1, 2])
    assert prefill(manager, req1) == ([], [3, 4, 5])
    assert manager.block_pool.num_cached_blocks == 0
    assert req1.block_hashes == []
    assert manager.get_cache_miss_reason("1") == "disabled"
    assert manager.prefix_cache_hit_rate == 0.0


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    req0 = make_request("0", range(33))
    prefill(manager, req0)
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(make_request("1", range(33))) == ([0, 1], 32)

    manager.free(req0)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("2", range(33))) == ([], 0)
    assert manager.get_cache_miss_reason("2") == "not_cached"


def test_invalid_arguments():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4).allocate_slots(make_request("0", [1]), -1)


def check_invariants(manager: KVCacheManager, running: list[Request]) -> None:
    pool = manager.block_pool
    num_holders = [0] * manager.num_blocks
    for request in running:
        block_ids = manager.get_block_ids(request.request_id)
        assert len(block_ids) == -(-request.num_computed_tokens // manager.block_size)
        for block_index, block_id in enumerate(block_ids):
            num_holders[block_id] += 1
            block_hash = pool.block_hash(block_id)
            # A cached block in a table holds exactly that request's tokens.
            assert block_hash is None or block_hash == request.block_hashes[block_index]
    assert ref_cnts(manager) == num_holders
    free_block_ids = pool.free_block_ids
    assert sorted(free_block_ids) == [b for b in range(manager.num_blocks) if num_holders[b] == 0]
    assert len(free_block_ids) + sum(1 for n in num_holders if n > 0) == manager.num_blocks
    for block_id in range(manager.num_blocks):
        block_hash = pool.block_hash(block_id)
        if block_hash is not None:
            assert pool.get_cached_block(block_hash) == block_id
    assert pool.num_cached_blocks == sum(1 for b in range(manager.num_blocks) if pool.block_hash(b) is not None)


@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_keep_invariants_and_kv_contents(seed):
    rng = random.Random(seed)
    block_size = 4
    manager = KVCacheManager(num_blocks=12, block_size=block_size)
    # What the model runner would have written into each block: stale KV must never be hit.
    block_contents = [[None] * block_size for _ in range(manager.num_blocks)]
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(13))] for _ in range(3)]
    waiting: list[Request] = []
    running: list[Request] = []

    def run(request: Request, num_new_tokens: int, computed_block_ids: list[int]) -> bool:
        block_ids = manager.get_block_ids(request.request_id)
        for block_index, block_id in enumerate(computed_block_ids):
            start = block_index * block_size
            assert block_contents[block_id] == request.all_token_ids[start : start + block_size]
        before = snapshot(manager, request.request_id)
        new_block_ids = manager.allocate_slots(request, num_new_tokens, computed_block_ids)
        if new_block_ids is None:
            assert snapshot(manager, request.request_id) == before
            return False
        for block_id in new_block_ids:
            block_contents[block_id] = [None] * block_size
        block_ids = manager.get_block_ids(request.request_id)
        start = request.num_computed_tokens + len(computed_block_ids) * block_size
        for position in range(start, start + num_new_tokens):
            block_contents[block_ids[position // block_size]][position % block_size] = request.all_token_ids[position]
        request.num_computed_tokens = start + num_new_tokens
        return True

    for step in range(400):
        action = rng.random()
        if action < 0.2:
            prompt = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
            waiting.append(make_request(f"{step}", prompt))
        elif action < 0.45 and waiting:
            request = waiting[0]
            computed_block_ids, num_computed_tokens = manager.get_computed_blocks(request)
            num_new_tokens = rng.randint(1, request.num_tokens - num_computed_tokens)
            if run(request, num_new_tokens, computed_block_ids):
                running.append(waiting.pop(0))
        elif action < 0.9 and running:
            request = rng.choice(running)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(rng.randrange(4))
            num_new_tokens = rng.randint(1, request.num_tokens - request.num_computed_tokens)
            if not run(request, num_new_tokens, []):
                # Preempt: drop its blocks and start over from the prefix cache.
                running.remove(request)
                manager.free(request)
                request.num_computed_tokens = 0
                waiting.insert(0, request)
        elif running:
            request = running.pop(rng.randrange(len(running)))
            manager.free(request)
        check_invariants(manager, running)

    for request in running + waiting:
        manager.free(request)
    check_invariants(manager, [])
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.usage == 0.0
    assert manager.num_hit_tokens > 0
    assert manager.block_pool.num_evicted_blocks > 0


def test_a_miss_on_an_evicted_block_says_evicted():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    req_a = make_request("a", range(49))  # blocks 0-2 full and cached, block 3 partial
    prefill(manager, req_a)
    manager.free(req_a)
    # Another prompt needs all four blocks: a's cached blocks are evicted for it.
    req_b = make_request("b", range(1000, 1064))
    prefill(manager, req_b)
    assert manager.get_cache_miss_reason("b") == "not_cached"
    manager.free(req_b)

    req_a2 = make_request("a2", range(49))
    assert manager.get_computed_blocks(req_a2) == ([], 0)
    assert manager.get_cache_miss_reason("a2") == "evicted"
    # Cached again, the hash is no longer "evicted": a later diverging prompt is "not_cached".
    prefill(manager, req_a2)
    manager.free(req_a2)
    req_c = make_request("c", list(range(16)) + list(range(5000, 5040)))
    assert manager.get_computed_blocks(req_c)[1] == 16
    assert manager.get_cache_miss_reason("c") == "not_cached"


def test_sliding_window_gives_back_blocks_behind_the_window_and_keeps_them_cached():
    manager = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    assert manager.num_free_blocks == 9  # the null block stands in for given-back ones
    request = make_request("a", range(20))
    prefill(manager, request)  # 5 blocks, positions 0..19
    assert manager.num_free_blocks == 4
    first_blocks = list(manager.get_block_ids("a"))[:3]
    request.append_output_token_ids(99)
    # The next query is at position 20: it and later ones see keys 15.. on, so blocks 0-2 (0..11) go.
    assert len(manager.allocate_slots(request, 1)) == 1  # position 20 opens block 5
    table = manager.get_block_ids("a")
    assert table[:3] == [manager.null_block] * 3 and len(table) == 6  # still indexed by position
    assert manager.num_free_blocks == 4 - 1 + 3
    # Given back, not forgotten: a prompt ending after block 2 hits blocks 1-2, all its next query
    # reads (keys 7..12); block 0 is skipped, not taken.
    again = make_request("b", range(13))
    assert manager.get_computed_blocks(again) == ([manager.null_block] + first_blocks[1:], 12)
    manager.free(request)
    assert manager.num_free_blocks == 9 and manager.reset_prefix_cache()


def test_without_a_window_no_block_is_given_back():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    request = make_request("a", range(20))
    prefill(manager, request)
    request.append_output_token_ids(99)
    manager.allocate_slots(request, 1)
    assert manager.null_block is None and len(set(manager.get_block_ids("a"))) == 6
