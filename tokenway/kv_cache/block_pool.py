"""The pool of KV blocks: ref counts, the free queue and the prefix-cache map.

Blocks are ints 0..num_blocks-1. A block is in use while its ref_cnt > 0 (one ref per
block table holding it) and in the free queue while its ref_cnt is 0. A free block may
still carry a hash: its KV stays valid and can be hit until the block is handed out
again, which is the only moment a cached block is evicted. The free queue is in LRU
order, least recently freed at the head, so eviction takes the coldest block first.

Owned by KVCacheManager; nothing else touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_cnts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        # Keys only (values are None): O(1) pop at the head, append at the tail and
        # removal from the middle when a cached free block is hit.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block_id: dict[bytes, int] = {}
        self.num_evicted_blocks = 0  # cached blocks whose hash was dropped to reuse them
        # Hashes evicted lately (bounded, oldest dropped first), so a miss can say "evicted"
        # rather than "never cached". A hash cached again leaves the set.
        self._evicted_hashes: OrderedDict[bytes, None] = OrderedDict()
        self._max_evicted_hashes = 4 * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block_id)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; free cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def free_block_ids(self) -> list[int]:
        """The free queue, next to be handed out first. A copy, for tests and metrics."""
        return list(self._free_block_ids)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hashes[block_id]

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self._hash_to_block_id.get(block_hash)

    def was_evicted(self, block_hash: bytes) -> bool:
        """Whether block_hash was cached and then evicted (as far as the bounded memory goes)."""
        return block_hash in self._evicted_hashes

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take num_blocks blocks from the head of the free queue, each with ref_cnt 1."""
        if num_blocks < 0 or num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_block_ids.popitem(last=False)
            assert self._ref_cnts[block_id] == 0
            block_hash = self._block_hashes[block_id]
            if block_hash is not None:
                # Evict now, not when freed: the KV stayed hittable until the block was needed.
                assert self._hash_to_block_id[block_hash] == block_id
                del self._hash_to_block_id[block_hash]
                self._block_hashes[block_id] = None
                self.num_evicted_blocks += 1
                self._evicted_hashes[block_hash] = None
                if len(self._evicted_hashes) > self._max_evicted_hashes:
                    self._evicted_hashes.popitem(last=False)
            self._ref_cnts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more ref on each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            if self._ref_cnts[block_id] == 0:
                del self._free_block_ids[block_id]
            self._ref_cnts[block_id] += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one ref on each block; blocks reaching 0 join the queue tail in the given order.

        Callers pass a request's blocks tail first, so its tail blocks (the least shareable)
        are evicted before its head blocks.
        """
        for block_id in ordered_block_ids:
            assert self._ref_cnts[block_id] > 0, f"block {block_id} freed more often than taken"
            self._ref_cnts[block_id] -= 1
            if self._ref_cnts[block_id] == 0:
                self._free_block_ids[block_id] = None

    def cache_full_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, in-use block hittable under block_hash.

        If another block already holds that hash it keeps it and this block stays uncached
        (two requests computed the same prefix at the same time); it is freed as usual.
        """
        if not self.enable_caching:
            return
        assert self._ref_cnts[block_id] > 0, f"caching block {block_id}, which is not in use"
        current_hash = self._block_hashes[block_id]
        if current_hash is not None:
            # A full block's content never changes, so neither does its hash.
            assert current_hash == block_hash, f"block {block_id} re-cached under another hash"
            return
        if block_hash in self._hash_to_block_id:
            return
        self._hash_to_block_id[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        self._evicted_hashes.pop(block_hash, None)

    def reset_prefix_cache(self, num_held: int = 0) -> bool:
        """Forget every cached hash. Only allowed when no block is in use but `num_held` uncached
        ones (a manager's null block); returns success."""
        if self.num_free_blocks != self.num_blocks - num_held:
            return False
        self._hash_to_block_id.clear()
        self._block_hashes = [None] * self.num_blocks
        self._evicted_hashes.clear()
        return True
