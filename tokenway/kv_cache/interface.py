"""What the KV cache needs from the rest of the engine, and how its memory is split into groups.

A KV cache group is a set of layers that attend alike (every key, or the last `window` keys) and
so can share one block table per request. A model whose layers mix full and sliding-window
attention (Gemma 3, Qwen2 with use_sliding_window) has two groups, each with its own blocks:
the sliding group's requests give back what falls behind their window, the full group's keep
everything. `plan_groups` sizes them from the KV memory budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class CacheRequest(Protocol):
    """The view of a request the KV cache reads (engine.request.Request has it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...  # all known tokens: prompt and output

    @property
    def num_computed_tokens(self) -> int: ...  # tokens whose KV is in the cache

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> list[bytes]: ...  # the cache appends to it (block_hash.update_block_hashes)


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group: its blocks (each holds block_size tokens of K and V for each of its layers)."""

    num_blocks: int
    window: int | None = None  # keys a query of these layers sees, its own included; None: every key
    num_layers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.window is not None and self.num_blocks < 2:
            raise ValueError("a sliding-window group needs 2 blocks or more (one stands in for those given back)")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_window_blocks(window: int, block_size: int) -> int:
    """Blocks a running request holds in a sliding group, a prompt chunk's aside: those of keys
    [p - window + 1, p] for its query p (at most cdiv(window - 1, block_size) + 1), and one more
    for a step's tokens that cross into the next block (a decode with drafts)."""
    return cdiv(window - 1, block_size) + 2


def plan_groups(
    memory: int,
    layer_block_bytes: int,
    layer_windows: Sequence[int | None],
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> tuple[KVCacheGroupSpec, ...]:
    """Split `memory` bytes of KV cache into groups, full-attention group first.

    layer_block_bytes: K and V of one block of one layer. layer_windows: each layer's window (None:
    full attention). Where layers mix, the sliding group gets the blocks max_num_seqs requests hold
    in it at once (each its window, max_window_blocks) plus one step's new tokens
    (max_num_batched_tokens), and the full group the rest: a long request then holds its whole
    context in the full layers only. The sliding group never gets more blocks than one pool for
    every layer would have (the layout before groups): where the budget cannot spare them, that
    layout is kept (one group), so no workload fits fewer requests than before.
    """
    num_layers = len(layer_windows)
    windows = {window for window in layer_windows if window is not None}
    if len(windows) > 1:
        raise ValueError(f"layers with different windows ({sorted(windows)}) are not supported")
    num_blocks = memory // (num_layers * layer_block_bytes)  # one pool for every layer
    if not windows:
        return (KVCacheGroupSpec(num_blocks, None, num_layers),)
    window = windows.pop()
    num_sliding_layers = sum(window is not None for window in layer_windows)
    if num_sliding_layers == num_layers:
        return (KVCacheGroupSpec(num_blocks, window, num_layers),)
    if window >= max_model_len:  # no query is ever past the window: nothing to give back
        return (KVCacheGroupSpec(num_blocks, None, num_layers),)
    per_request = min(max_window_blocks(window, block_size), cdiv(max_model_len, block_size))
    num_sliding_blocks = max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size) + 1  # + the null block
    if num_sliding_blocks >= num_blocks:
        return (KVCacheGroupSpec(num_blocks, None, num_layers),)
    num_full_layers = num_layers - num_sliding_layers
    num_full_blocks = (memory - num_sliding_blocks * num_sliding_layers * layer_block_bytes) // (
        num_full_layers * layer_block_bytes)
    return (KVCacheGroupSpec(num_full_blocks, None, num_full_layers),
            KVCacheGroupSpec(num_sliding_blocks, window, num_sliding_layers))
