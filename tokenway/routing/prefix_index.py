"""The balancer's guess of what each replica holds in its prefix cache.

The balancer cannot see a replica's KV cache, so it remembers what it sent there: the chained
hashes of the full blocks of every prompt it routed to that replica, in an LRU bounded in
size. A prompt's match on a replica is the number of its leading blocks found there, which
approximates the replica's own prefix-cache hit (SGLang's cache-aware router keeps a radix tree
for the same purpose; a map over chained hashes is that tree flattened, as the engine's own
prefix cache is: kv_cache/block_hash.py).

    prompt_token_ids ─► prefix_block_hashes (one hash per full block, each covering its parent)
                     ─► PrefixIndex.num_matched_blocks on each replica ─► the balancer's rule

These hashes are the router's own: process-local, cheap (Python's hash of a tuple of ints,
~25 ns a token) and never compared with the engine's. A collision costs one misrouted call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of token_ids; hash i covers blocks 0..i, so equal hashes mean
    equal whole prefixes. The partial last block is left out: the engine caches full blocks only."""
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    block_hashes: list[int] = []
    parent_hash = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash((parent_hash, *token_ids[start : start + block_size]))
        block_hashes.append(parent_hash)
    return block_hashes


class PrefixIndex:
    """The block hashes recently routed to one replica, at most max_num_blocks of them."""

    def __init__(self, max_num_blocks: int) -> None:
        if max_num_blocks < 1:
            raise ValueError(f"max_num_blocks: must be >= 1, got {max_num_blocks}")
        self.max_num_blocks = max_num_blocks
        # Least recently routed first; the values are unused (an ordered set).
        self._block_hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._block_hashes)

    def num_matched_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica was sent recently."""
        num_matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._block_hashes:
                break
            num_matched += 1
        return num_matched

    def insert(self, block_hashes: Sequence[int]) -> None:
        """Record a prompt routed here. Deepest block first, so the root ends most recent:
        eviction then trims a chain from its tail, as an engine's prefix cache does, and never
        strands a long tail behind an evicted root that no match could reach."""
        for block_hash in reversed(block_hashes):
            self._block_hashes[block_hash] = None
            self._block_hashes.move_to_end(block_hash)
        while len(self._block_hashes) > self.max_num_blocks:
            self._block_hashes.popitem(last=False)
