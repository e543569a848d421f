"""KVCacheGroup: the block tables of one KV cache group and the BlockPool they draw from.

A request's table in a group is indexed by position: entry i holds tokens
[i * block_size, (i + 1) * block_size) for the group's layers. In a sliding-window group, leading
entries no query of the request reads again are the group's null block (a real id, held forever,
that nothing reads): they were given back as the request advanced, or never taken at a prefix-cache
hit. Only KVCacheManager calls this; it keeps the groups in step (all-or-nothing allocation).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenway.kv_cache.block_pool import BlockPool
from tokenway.kv_cache.interface import CacheRequest, KVCacheGroupSpec, cdiv


class KVCacheGroup:
    def __init__(self, spec: KVCacheGroupSpec, block_size: int, enable_caching: bool) -> None:
        self.spec = spec
        self.window = spec.window
        self.block_size = block_size
        self.block_pool = BlockPool(spec.num_blocks, enable_caching=enable_caching)
        self.null_block = self.block_pool.get_new_blocks(1)[0] if spec.window is not None else None
        self._request_id_to_block_ids: dict[str, list[int]] = {}
        # Leading entries of a table that are the null block.
        self._request_id_to_num_skipped: dict[str, int] = {}
        # Leading entries already offered to the prefix cache, so each step only looks at the
        # blocks that became full since the last one.
        self._request_id_to_num_cached: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block is none of them)."""
        return self.block_pool.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._request_id_to_block_ids.get(request_id, [])

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at position num_computed_tokens or later reads: each sees the
        keys from its position - window + 1 on."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of at most max_num_blocks blocks this group can
        resume after: every block for full attention; for a window, the blocks its first query
        reads (the null block stands for those before them). Ref counts are untouched."""
        pool = self.block_pool
        if self.window is None:
            hit_block_ids = []
            for block_hash in block_hashes[:max_num_blocks]:
                block_id = pool.get_cached_block(block_hash)
                if block_id is None:
                    break
                hit_block_ids.append(block_id)
            return hit_block_ids
        assert self.null_block is not None
        # A query right after the hit reads its last cdiv(window - 1, block_size) blocks. Search from
        # the longest prefix down for such a run; a prefix shorter than one is a hit when whole.
        num_needed = cdiv(self.window - 1, self.block_size)
        hit_block_ids = [self.null_block] * max_num_blocks
        num_contiguous = 0
        for index in range(max_num_blocks - 1, -1, -1):
            if num_contiguous >= num_needed:
                return hit_block_ids[: index + 1 + num_contiguous]
            block_id = pool.get_cached_block(block_hashes[index])
            if block_id is None:
                num_contiguous = 0
            else:
                hit_block_ids[index] = block_id
                num_contiguous += 1
        return hit_block_ids[:num_contiguous]  # the run from block 0 (all of it when it reached num_needed)

    def first_missing_block(self, block_hashes: Sequence[bytes], start: int, end: int) -> int | None:
        """The first index in [start, end) whose block this group does not have cached."""
        return next((index for index in range(start, end)
                     if self.block_pool.get_cached_block(block_hashes[index]) is None), None)

    def num_blocks_short(self, request_id: str, num_computed_tokens: int, hit_block_ids: Sequence[int],
                         num_tokens: int) -> int:
        """How many more free blocks allocate() would need than the pool has (0: it can go ahead).

        num_computed_tokens counts the hit; num_tokens is every token that needs a slot."""
        block_ids = self._request_id_to_block_ids.get(request_id, [])
        num_new = max(0, cdiv(num_tokens, self.block_size) - len(block_ids) - len(hit_block_ids))
        # A hit on a free cached block takes it out of the free queue; a block given back on the way
        # joins it (when this request was its last holder).
        num_taken = sum(1 for block_id in hit_block_ids
                        if block_id != self.null_block and self.block_pool.ref_cnt(block_id) == 0)
        skipped = self._request_id_to_num_skipped.get(request_id, 0)
        num_given_back = sum(1 for block_id in block_ids[skipped: self.num_skipped_blocks(num_computed_tokens)]
                             if self.block_pool.ref_cnt(block_id) == 1)
        return max(0, num_new + num_taken - num_given_back - self.num_free_blocks)

    def allocate(self, request_id: str, num_computed_tokens: int, hit_block_ids: Sequence[int],
                 num_tokens: int) -> list[int]:
        """Give back the blocks behind the window, take the hit, then new blocks up to num_tokens
        slots; returns the new block ids. num_blocks_short() must have said 0."""
        block_ids = self._request_id_to_block_ids.setdefault(request_id, [])
        # Hits only ever start a table, and only the first time it is filled.
        assert not hit_block_ids or not block_ids
        self._give_back(request_id, block_ids, num_computed_tokens)
        if hit_block_ids:
            num_skipped = self.num_skipped_blocks(num_computed_tokens)
            assert all(block_id == self.null_block for block_id in hit_block_ids[:num_skipped])
            # Touch the hits before taking new blocks, so that taking them cannot evict a hit.
            self.block_pool.touch(hit_block_ids[num_skipped:])
            block_ids.extend(hit_block_ids)
            self._request_id_to_num_skipped[request_id] = num_skipped
            self._request_id_to_num_cached[request_id] = len(hit_block_ids)  # hits are cached already
        num_new = max(0, cdiv(num_tokens, self.block_size) - len(block_ids))
        new_block_ids = self.block_pool.get_new_blocks(num_new)
        block_ids.extend(new_block_ids)
        return new_block_ids

    def _give_back(self, request_id: str, block_ids: list[int], num_computed_tokens: int) -> None:
        """Blocks stay in the prefix cache once given back (free, evictable), as a finished request's do."""
        skipped = self._request_id_to_num_skipped.get(request_id, 0)
        num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(block_ids))
        if num_skipped <= skipped:
            return
        assert self.null_block is not None
        self.block_pool.free_blocks(block_ids[skipped:num_skipped])
        block_ids[skipped:num_skipped] = [self.null_block] * (num_skipped - skipped)
        self._request_id_to_num_skipped[request_id] = num_skipped

    def cache_full_blocks(self, request: CacheRequest, num_known_tokens: int) -> None:
        """Make the request's blocks that are full of its first num_known_tokens tokens hittable."""
        request_id = request.request_id
        block_ids = self._request_id_to_block_ids[request_id]
        num_cached = self._request_id_to_num_cached.get(request_id, 0)
        num_full = num_known_tokens // self.block_size
        for index in range(num_cached, num_full):
            if block_ids[index] != self.null_block:
                self.block_pool.cache_full_block(block_ids[index], request.block_hashes[index])
        self._request_id_to_num_cached[request_id] = max(num_cached, num_full)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (its tail is the least shareable). Idempotent."""
        block_ids = self._request_id_to_block_ids.pop(request_id, None)
        skipped = self._request_id_to_num_skipped.pop(request_id, 0)
        self._request_id_to_num_cached.pop(request_id, None)
        if block_ids is not None:
            self.block_pool.free_blocks(reversed(block_ids[skipped:]))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache(num_held=self.null_block is not None)
