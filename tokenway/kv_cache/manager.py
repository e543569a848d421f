"""KVCacheManager: the scheduler's only door to the paged KV cache.

Per step the scheduler, for a request it wants to run:
  get_computed_blocks(request) -> (cached block ids, num cached tokens)   # waiting requests only
  allocate_slots(request, num_new_tokens, cached block ids) -> new block ids | None
and free(request) when it finishes or is preempted. The manager owns every block table
(request_id -> block ids, block i holds tokens [i * block_size, (i + 1) * block_size)) and
the BlockPool; the scheduler never sees a ref count.

A block is cached (hittable) as soon as it is allocated for tokens that fill it, before
their KV is written. That is sound because (1) the step that allocated it writes that KV,
and a request scheduled later in the same step may read it only because the model runner
writes each layer's KV for the whole batch before attention reads any of it; (2) the
scheduler never frees a request between allocate_slots and running the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenway.engine.request import Request
from tokenway.kv_cache.block_hash import update_block_hashes
from tokenway.kv_cache.block_pool import BlockPool

# Why get_computed_blocks stopped where it did (see get_cache_miss_reason); the number of
# blocks that did hit is num_computed_tokens // block_size.
CACHE_HIT = "hit"  # every block that may be reused was cached
CACHE_NO_FULL_BLOCK = "no_full_block"  # no full block lies before the last token
CACHE_NOT_CACHED = "not_cached"  # the first block that missed was never cached (no prompt shared it)
CACHE_EVICTED = "evicted"  # the first block that missed had been cached, then evicted for room
CACHE_DISABLED = "disabled"  # prefix caching is off


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        namespace: str = "",
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: every layer of the model attends to this many keys at most (Mistral
        v0.1, Phi-3 4k): a request's blocks that fall out of it go back to the pool as it runs."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace  # the model: hashes from different namespaces never match
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.sliding_window = sliding_window
        # Stands in a block table for blocks given back (a valid id no query reads); held forever.
        self.null_block = self.block_pool.get_new_blocks(1)[0] if sliding_window else None
        # Leading entries of each block table given back (now null_block).
        self._request_id_to_num_released: dict[str, int] = {}
        self._request_id_to_block_ids: dict[str, list[int]] = {}
        # Leading blocks of each request already offered to the cache, so each step only
        # looks at the blocks that became full since the last one.
        self._request_id_to_num_cached_blocks: dict[str, int] = {}
        self._request_id_to_cache_miss_reason: dict[str, str] = {}
        # (queried, hit) tokens of a lookup, counted once its allocation succeeds: a request
        # that waits for blocks repeats its lookup every step and must not count each time.
        self._request_id_to_pending_query: dict[str, tuple[int, int]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens over lookups whose allocation succeeded; 0 before any."""
        if self.num_queried_tokens == 0:
            return 0.0
        return self.num_hit_tokens / self.num_queried_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds no blocks). Do not mutate."""
        return self._request_id_to_block_ids.get(request_id, [])

    def get_cache_miss_reason(self, request_id: str) -> str | None:
        """The outcome of the request's last prefix-cache lookup; kept until free(request)."""
        return self._request_id_to_cache_miss_reason.get(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of leading cached blocks: (block ids, num computed tokens).

        Ref counts are untouched; pass the ids to allocate_slots to take them.
        """
        if request.num_computed_tokens != 0:
            return [], 0
        if not self.enable_prefix_caching:
            self._request_id_to_cache_miss_reason[request.request_id] = CACHE_DISABLED
            return [], 0
        update_block_hashes(request, self.block_size, self.namespace)
        # NOTE: When all tokens hit the cache, we must recompute the last token to obtain
        # logits, so only blocks lying entirely within the first num_tokens - 1 count.
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        computed_block_ids = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            computed_block_ids.append(block_id)
        num_computed_tokens = len(computed_block_ids) * self.block_size

        self._request_id_to_pending_query[request.request_id] = (request.num_tokens, num_computed_tokens)
        if max_num_blocks == 0:
            reason = CACHE_NO_FULL_BLOCK
        elif len(computed_block_ids) == max_num_blocks:
            reason = CACHE_HIT
        elif self.block_pool.was_evicted(request.block_hashes[len(computed_block_ids)]):
            reason = CACHE_EVICTED
        else:
            reason = CACHE_NOT_CACHED
        self._request_id_to_cache_miss_reason[request.request_id] = reason
        return computed_block_ids, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
    ) -> list[int] | None:
        """Make room for the request's computed tokens, the cache hits and num_new_tokens.

        Returns the newly allocated block ids, or None (and changes nothing) when there are
        not enough free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        request_id = request.request_id
        block_ids = self._request_id_to_block_ids.get(request_id, [])
        if self.sliding_window and block_ids:
            self._release_out_of_window(request_id, block_ids, request.num_computed_tokens)
        # Cache hits only ever start a block table, and only the first time it is filled.
        assert not new_computed_block_ids or (not block_ids and request.num_computed_tokens == 0)
        num_computed_tokens = request.num_computed_tokens + len(new_computed_block_ids) * self.block_size
        num_tokens = num_computed_tokens + num_new_tokens
        num_required_blocks = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(block_ids) - len(new_computed_block_ids))
        # A hit on a free cached block takes it out of the free queue.
        num_hit_free_blocks = sum(1 for block_id in new_computed_block_ids if self.block_pool.ref_cnt(block_id) == 0)
        if num_new_blocks + num_hit_free_blocks > self.block_pool.num_free_blocks:
            return None

        # Touch the hits before taking new blocks, so that taking them cannot evict a hit.
        self.block_pool.touch(new_computed_block_ids)
        new_block_ids = self.block_pool.get_new_blocks(num_new_blocks)
        block_ids.extend(new_computed_block_ids)
        block_ids.extend(new_block_ids)
        self._request_id_to_block_ids[request_id] = block_ids
        pending_query = self._request_id_to_pending_query.pop(request_id, None)
        if pending_query is not None:
            self.num_queried_tokens += pending_query[0]
            self.num_hit_tokens += pending_query[1]

        if self.enable_prefix_caching:
            self._cache_full_blocks(request, block_ids, min(num_tokens, request.num_tokens))
        return new_block_ids

    def _release_out_of_window(self, request_id: str, block_ids: list[int], num_computed_tokens: int) -> None:
        """Give back the leading blocks no query of this request will read again: the next query is
        at position num_computed_tokens, and it and every later one see keys from
        num_computed_tokens - window + 1 on. A given-back block stays in the prefix cache (free,
        evictable), as a finished request's do."""
        first_kept = max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size
        released = self._request_id_to_num_released.get(request_id, 0)
        if first_kept <= released:
            return
        self.block_pool.free_blocks(block_ids[released:first_kept])
        block_ids[released:first_kept] = [self.null_block] * (first_kept - released)
        self._request_id_to_num_released[request_id] = first_kept

    def _cache_full_blocks(self, request: Request, block_ids: list[int], num_known_tokens: int) -> None:
        update_block_hashes(request, self.block_size, self.namespace)
        num_cached_blocks = self._request_id_to_num_cached_blocks.get(request.request_id, 0)
        num_full_blocks = num_known_tokens // self.block_size
        for block_index in range(num_cached_blocks, num_full_blocks):
            self.block_pool.cache_full_block(block_ids[block_index], request.block_hashes[block_index])
        self._request_id_to_num_cached_blocks[request.request_id] = max(num_cached_blocks, num_full_blocks)

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first. Idempotent."""
        request_id = request.request_id
        block_ids = self._request_id_to_block_ids.pop(request_id, None)
        self._request_id_to_num_cached_blocks.pop(request_id, None)
        self._request_id_to_cache_miss_reason.pop(request_id, None)
        self._request_id_to_pending_query.pop(request_id, None)
        released = self._request_id_to_num_released.pop(request_id, 0)
        if block_ids is not None:
            self.block_pool.free_blocks(reversed(block_ids[released:]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only succeeds when no block is in use."""
        return self.block_pool.reset_prefix_cache(num_held=0 if self.null_block is None else 1)
