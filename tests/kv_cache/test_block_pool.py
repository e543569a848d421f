import pytest

from tokenway.kv_cache.block_hash import hash_block_tokens
from tokenway.kv_cache.block_pool import BlockPool


def make_hash(i: int) -> bytes:
    return hash_block_tokens(None, [i], "test")


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(num_blocks=5)
    assert pool.free_block_ids == [0, 1, 2, 3, 4]
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.get_new_blocks(0) == []
    assert [pool.ref_cnt(b) for b in range(5)] == [1, 1, 0, 0, 0]
    assert pool.free_block_ids == [2, 3, 4]
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(0.4)


def test_get_new_blocks_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.free_block_ids == [2]
    assert [pool.ref_cnt(b) for b in range(3)] == [1, 1, 0]


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0)


def test_free_appends_to_tail_in_given_order():
    pool = BlockPool(num_blocks=5)
    pool.get_new_blocks(4)
    pool.free_blocks([3, 1, 0])
    assert pool.free_block_ids == [4, 3, 1, 0]
    assert [pool.ref_cnt(b) for b in range(5)] == [0, 0, 1, 0, 0]


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(num_blocks=3)
    (block_id,) = pool.get_new_blocks(1)
    pool.touch([block_id])
    assert pool.ref_cnt(block_id) == 2
    pool.free_blocks([block_id])
    assert pool.ref_cnt(block_id) == 1
    assert pool.free_block_ids == [1, 2]
    pool.free_blocks([block_id])
    assert pool.ref_cnt(block_id) == 0
    assert pool.free_block_ids == [1, 2, 0]


def test_freeing_a_free_block_is_an_invariant_violation():
    pool = BlockPool(num_blocks=2)
    with pytest.raises(AssertionError):
        pool.free_blocks([0])


def test_cache_full_block_keeps_the_existing_mapping():
    pool = BlockPool(num_blocks=3)
    pool.get_new_blocks(2)
    pool.cache_full_block(0, make_hash(7))
    pool.cache_full_block(1, make_hash(7))
    assert pool.get_cached_block(make_hash(7)) == 0
    assert pool.block_hash(0) == make_hash(7)
    assert pool.block_hash(1) is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_caches_nothing():
    pool = BlockPool(num_blocks=2, enable_caching=False)
    pool.get_new_blocks(1)
    pool.cache_full_block(0, make_hash(0))
    assert pool.get_cached_block(make_hash(0)) is None
    assert pool.block_hash(0) is None


def test_cached_block_survives_free_and_is_evicted_lru_on_reuse():
    pool = BlockPool(num_blocks=4)
    assert pool.get_new_blocks(4) == [0, 1, 2, 3]
    for block_id in range(3):
        pool.cache_full_block(block_id, make_hash(block_id))
    pool.free_blocks([2, 0, 3, 1])
    # Still hittable while free.
    assert pool.free_block_ids == [2, 0, 3, 1]
    assert [pool.get_cached_block(make_hash(i)) for i in range(3)] == [0, 1, 2]
    assert pool.num_evicted_blocks == 0

    # Least recently freed first: block 2, then block 0.
    assert pool.get_new_blocks(1) == [2]
    assert pool.get_cached_block(make_hash(2)) is None
    assert pool.block_hash(2) is None
    assert pool.num_evicted_blocks == 1
    assert pool.get_new_blocks(1) == [0]
    assert pool.get_cached_block(make_hash(0)) is None
    # Block 3 was never cached: reusing it evicts nothing.
    assert pool.get_new_blocks(1) == [3]
    assert pool.num_evicted_blocks == 2
    assert pool.get_cached_block(make_hash(1)) == 1


def test_touch_takes_a_free_cached_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(num_blocks=4)
    pool.get_new_blocks(4)
    pool.cache_full_block(1, make_hash(1))
    pool.free_blocks([0, 1, 2, 3])
    pool.touch([1])
    assert pool.ref_cnt(1) == 1
    assert pool.free_block_ids == [0, 2, 3]
    assert pool.get_new_blocks(3) == [0, 2, 3]
    assert pool.get_cached_block(make_hash(1)) == 1
    assert pool.num_evicted_blocks == 0


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(num_blocks=3)
    pool.get_new_blocks(2)
    pool.cache_full_block(0, make_hash(0))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(make_hash(0)) == 0

    pool.free_blocks([1, 0])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(make_hash(0)) is None
    assert pool.block_hash(0) is None
    assert pool.num_cached_blocks == 0
    assert pool.free_block_ids == [2, 1, 0]
    # Forgotten hashes are not evictions.
    pool.get_new_blocks(3)
    assert pool.num_evicted_blocks == 0
