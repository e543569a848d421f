"""KVCacheManager: the scheduler's only door to the paged KV cache.

Per step the scheduler, for a request it wants to run:
  get_computed_blocks(request) -> (cached block ids, num cached tokens)   # waiting requests only
  allocate_slots(request, num_new_tokens, cached block ids) -> new block ids | None
and free(request) when it finishes or is preempted. The scheduler never sees a ref count.

Layers that attend alike form a KV cache group (interface.py): every layer of most models is
one group; Gemma 3's and windowed Qwen2's full-attention layers are one and their sliding-window
layers another. Each group has its own BlockPool (its blocks hold K and V of its layers only,
sized by interface.plan_groups) and its own block table per request (group.py), which the model
runner lays out for those layers. A request's table in a sliding group gives back the blocks
that fall behind the window as the request advances, and takes none of them at a prefix-cache
hit, so a long context costs its full length in the full layers only.

The groups move together: allocate_slots gives blocks in every group or, when any group is
short, returns None and changes nothing; free() releases every group. A prefix-cache hit is the
longest block-aligned prefix every group can resume after: the full group needs each of its
blocks cached, a sliding group only the blocks the next query reads (vLLM's hybrid KV cache
manager, kv_cache_coordinator.py, does the same).

A block is cached (hittable) as soon as it is allocated for tokens that fill it, before
their KV is written. That is sound because (1) the step that allocated it writes that KV,
and a request scheduled later in the same step may read it only because the model runner
writes each layer's KV for the whole batch before attention reads any of it; (2) the
scheduler never frees a request between allocate_slots and running the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenway.kv_cache.block_hash import update_block_hashes
from tokenway.kv_cache.block_pool import BlockPool
from tokenway.kv_cache.group import KVCacheGroup
from tokenway.kv_cache.interface import CacheRequest, KVCacheGroupSpec

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
        num_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        namespace: str = "",
        sliding_window: int | None = None,
        groups: Sequence[KVCacheGroupSpec] = (),
    ) -> None:
        """groups: one spec per KV cache group, in the order the runner lays their tables out.
        num_blocks and sliding_window say the same for one group: every layer attends to the last
        sliding_window keys (Mistral v0.1, Phi-3 4k), or to every key (None)."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if groups and (num_blocks is not None or sliding_window is not None):
            raise ValueError("give either groups or num_blocks (and sliding_window), not both")
        if not groups:
            if num_blocks is None:
                raise ValueError("num_blocks or groups is required")
            groups = (KVCacheGroupSpec(num_blocks, sliding_window),)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace  # the model: hashes from different namespaces never match
        self.groups = tuple(KVCacheGroup(spec, block_size, enable_prefix_caching) for spec in groups)
        self._request_id_to_cache_miss_reason: dict[str, str] = {}
        # (queried, hit) tokens of a lookup, counted once its allocation succeeds: a request
        # that waits for blocks repeats its lookup every step and must not count each time.
        self._request_id_to_pending_query: dict[str, tuple[int, int]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # -- figures --------------------------------------------------------------------

    @property
    def block_pool(self) -> BlockPool:
        """The first group's pool (the only one for most models)."""
        return self.groups[0].block_pool

    @property
    def null_block(self) -> int | None:
        """The id standing in a sliding group's tables for blocks given back (None: no group slides)."""
        return next((group.null_block for group in self.groups if group.null_block is not None), None)

    @property
    def num_blocks(self) -> int:
        """The first group's blocks (the only group's, for most models)."""
        return self.groups[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (free cached blocks count as free). Where there are groups, the first group's
        blocks times the smallest free share of any group, so that 1 - num_free_blocks / num_blocks
        is the usage of the group nearest to running out: the one that stops admission."""
        if len(self.groups) == 1:
            return self.groups[0].num_free_blocks
        return int(self.num_blocks * min(group.num_free_blocks / group.num_blocks for group in self.groups))

    @property
    def usage(self) -> float:
        """The usage of the group nearest to running out."""
        return max(group.usage for group in self.groups)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens over lookups whose allocation succeeded; 0 before any."""
        if self.num_queried_tokens == 0:
            return 0.0
        return self.num_hit_tokens / self.num_queried_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table in the first group (empty if it holds no blocks). Do not mutate."""
        return self.groups[0].get_block_ids(request_id)

    def get_block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group, in group order. Do not mutate."""
        return tuple(group.get_block_ids(request_id) for group in self.groups)

    def get_cache_miss_reason(self, request_id: str) -> str | None:
        """The outcome of the request's last prefix-cache lookup; kept until free(request)."""
        return self._request_id_to_cache_miss_reason.get(request_id)

    # -- the scheduler's calls ------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[int], int]:
        """The longest prefix every group has cached: (block ids, num computed tokens).

        The ids are each group's blocks of the hit, group after group, num computed tokens //
        block_size per group (the null block for those a sliding group skips): pass them as they
        are to allocate_slots, which takes them. Ref counts are untouched.
        """
        if request.num_computed_tokens != 0:
            return [], 0
        if not self.enable_prefix_caching:
            self._request_id_to_cache_miss_reason[request.request_id] = CACHE_DISABLED
            return [], 0
        update_block_hashes(request, self.block_size, self.namespace)
        block_hashes = request.block_hashes
        # NOTE: When all tokens hit the cache, we must recompute the last token to obtain
        # logits, so only blocks lying entirely within the first num_tokens - 1 count.
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        # Each group takes the longest hit no longer than the others': a full group's hit holds
        # at any shorter length, a sliding group's may not, so go round until none shortens it.
        num_hit_blocks = max_num_blocks
        hits: list[list[int]] = [[] for _ in self.groups]
        limiting_group = self.groups[0]
        settled = False
        while not settled:
            settled = True
            for index, group in enumerate(self.groups):
                if group.window is None and len(hits[index]) >= num_hit_blocks:
                    hits[index] = hits[index][:num_hit_blocks]
                    continue
                hits[index] = group.find_longest_cache_hit(block_hashes, num_hit_blocks)
                if len(hits[index]) < num_hit_blocks:
                    num_hit_blocks, limiting_group, settled = len(hits[index]), group, False
        num_computed_tokens = num_hit_blocks * self.block_size

        self._request_id_to_pending_query[request.request_id] = (request.num_tokens, num_computed_tokens)
        if max_num_blocks == 0:
            reason = CACHE_NO_FULL_BLOCK
        elif num_hit_blocks == max_num_blocks:
            reason = CACHE_HIT
        else:
            missing = limiting_group.first_missing_block(block_hashes, num_hit_blocks, max_num_blocks)
            evicted = missing is not None and limiting_group.block_pool.was_evicted(block_hashes[missing])
            reason = CACHE_EVICTED if evicted else CACHE_NOT_CACHED
        self._request_id_to_cache_miss_reason[request.request_id] = reason
        return [block_id for hit in hits for block_id in hit], num_computed_tokens

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
    ) -> list[int] | None:
        """Make room for the request's computed tokens, the cache hits and num_new_tokens in every
        group; blocks behind a sliding window go back to their pool on the way.

        Returns the newly allocated block ids (group after group), or None, changing nothing,
        when any group has too few free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_groups = len(self.groups)
        assert len(new_computed_block_ids) % num_groups == 0, "pass the ids get_computed_blocks returned"
        num_hit_blocks = len(new_computed_block_ids) // num_groups
        hits = [new_computed_block_ids[index * num_hit_blocks: (index + 1) * num_hit_blocks]
                for index in range(num_groups)]
        num_computed_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens = num_computed_tokens + num_new_tokens
        if any(group.num_blocks_short(request.request_id, num_computed_tokens, hit, num_tokens)
               for group, hit in zip(self.groups, hits)):
            return None

        new_block_ids = []
        for group, hit in zip(self.groups, hits):
            new_block_ids += group.allocate(request.request_id, num_computed_tokens, hit, num_tokens)
        pending_query = self._request_id_to_pending_query.pop(request.request_id, None)
        if pending_query is not None:
            self.num_queried_tokens += pending_query[0]
            self.num_hit_tokens += pending_query[1]
        if self.enable_prefix_caching:
            update_block_hashes(request, self.block_size, self.namespace)
            # Drafts have slots but are not known tokens: their blocks are not cached.
            num_known_tokens = min(num_tokens, request.num_tokens)
            for group in self.groups:
                group.cache_full_blocks(request, num_known_tokens)
        return new_block_ids

    def free(self, request: CacheRequest) -> None:
        """Release all the request's blocks in every group, tail first. Idempotent."""
        request_id = request.request_id
        for group in self.groups:
            group.free(request_id)
        self._request_id_to_cache_miss_reason.pop(request_id, None)
        self._request_id_to_pending_query.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only succeeds when no block is in use."""
        if any(group.num_free_blocks != group.num_blocks for group in self.groups):
            return False
        return all([group.reset_prefix_cache() for group in self.groups])
