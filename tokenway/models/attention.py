"""Attention over the paged KV cache, for one step's flat batch [decode tokens | prefill chunks].

The cache of one layer is (num_slots, kv_heads, head_dim), slot = block_id * block_size + offset.

Decode rows (one query token each) attend in one batched call. Where tokenway's C++ kernel
(csrc/attention.cpp) builds, it reads each row's blocks in place through its block table: no
copy, no padding, and no per-shape state (a torch bf16 matmul keeps a oneDNN primitive per shape,
and decode shapes change every step). Rows behind a shared cached prefix (the runner finds them
once for both paths) name their group's leader and the prefix length: the kernel reads those
blocks once for all the group's queries. The runner asks `native_decode_kernel` once; the
metadata it lays out (block tables, or the torch path's layout below) says which path a step takes.

On the torch path, what a row reads is split in two:
  - a shared prefix: the first blocks it holds in common with other decode rows (a system prompt
    the prefix cache handed to all of them). Their keys and values are read ONCE per step for the
    whole group, and the group's queries meet them in one matmul: (kv_heads, rows x group, d) x
    (kv_heads, d, prefix). Without it, 16 requests behind a 1,000-token system prompt copied 16
    contexts out of the cache every layer of every step (cascade attention, as FlashInfer and
    vLLM call it);
  - its own blocks: the rest of its context, gathered per row and padded.
The scores of both parts are softmaxed together, so the result is ordinary attention over the
whole context. Block runs that happen to be consecutive in the cache (a long prompt allocated
at once usually is) are read as a view, with no copy at all.

Prefill chunks attend one by one: a whole prompt to itself (causal), a later chunk or the tail
after a prefix-cache hit to its cached context too.

Attention sinks (gpt-oss): a learned logit per query head that joins every query's softmax as one
more column whose value is zero, p = softmax([q.k_1 * scale, ..., q.k_n * scale, sink]), so it only
takes probability from the keys. Given sinks, every path above keeps its layout: the native kernel
adds the sink to each row's denominator; torch's SDPA has no sinks, so on the CPU its fused kernel
also returns each row's logsumexp (lse) and out * sigmoid(lse - sink) is the answer (the keys'
share of the probability, exactly); elsewhere scores are computed explicitly, in float32, a block
of queries at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenway import native

DecodeKernel = Callable[..., torch.Tensor]

# Queries per block where scores are computed explicitly: (heads, block, keys) float32 stays
# within this many elements (64 MiB), a 2k-token prompt's 64 heads included.
MAX_EXPLICIT_SCORES = 1 << 24


@dataclass(slots=True)
class BlockRun:
    """Whole blocks read in order: their ids, and the first id when they are consecutive."""

    block_ids: torch.Tensor  # (num_blocks,) long
    first_block: int | None  # block_ids == first_block + arange(num_blocks): read as a view

    @classmethod
    def of(cls, block_ids: list[int], device: torch.device) -> BlockRun:
        first = block_ids[0] if block_ids and all(b - a == 1 for a, b in zip(block_ids, block_ids[1:])) else None
        return cls(torch.tensor(block_ids, dtype=torch.long, device=device), first)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def read(self, cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """(num_blocks * block_size, kv_heads, head_dim): a view when consecutive, else a copy."""
        if self.first_block is not None:
            start = self.first_block * block_size
            return cache[start : start + self.num_blocks * block_size]
        return gather_blocks(cache, self.block_ids, block_size)


@dataclass(slots=True)
class PrefillChunk:
    """One request's run of query tokens that attends to its own context."""

    token_start: int  # first index in the flat batch
    num_tokens: int  # query tokens in this chunk
    context_len: int  # keys read from the context's first block on (all computed tokens + this chunk, unless windowed)
    context: BlockRun | None  # the blocks holding the context; None when the chunk is the whole context
    attn_mask: torch.Tensor | None  # (num_tokens, context_len) bool, True = may attend; None = plain causal


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows whose contexts start with the same cached blocks."""

    rows: torch.Tensor  # (num_rows,) long: indices among the decode rows
    blocks: BlockRun


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: cache slot (block_id * block_size + offset) of each new token
    block_size: int = 16
    num_decode_tokens: int = 0  # Bd: the first Bd tokens are single-token decodes
    # The native kernel's layout: every decode row's whole block table and context length.
    decode_kernel: DecodeKernel | None = None
    decode_block_tables: torch.Tensor | None = None  # (Bd, max_blocks) int32; entries past a row's blocks unused
    decode_context_lens: torch.Tensor | None = None  # (Bd,) int32
    # Rows sharing a cached prefix: each row's first prefix_lens[r] keys are row prefix_leaders[r]'s blocks.
    decode_prefix_leaders: torch.Tensor | None = None  # (Bd,) int32, None: no shared prefix this step
    decode_prefix_lens: torch.Tensor | None = None  # (Bd,) int32 tokens, whole blocks (0: none)
    # The torch path's layout. Each decode row's own blocks (its context after any shared prefix), padded with block 0.
    decode_block_table: torch.Tensor | None = None  # (Bd, max_blocks) long
    decode_mask: torch.Tensor | None = None  # (Bd, 1, 1, max_blocks * block_size) bool, True = valid key
    # A single decode row whose blocks are consecutive: its context is read as a view instead.
    decode_context: BlockRun | None = None
    decode_context_len: int = 0
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Keys a query sees, its own included (sliding-window layers); None: the whole context.
    window: int | None = None
    # The same step laid out for the model's sliding-window layers, in their KV cache group's blocks
    # (slots and tables of their own where layers mix; None: the model has no such layer).
    sliding: AttentionMetadata | None = None


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(num_slots, kv_heads, head_dim) cache, (*, nb) block ids -> (*, nb * block_size, kv_heads, head_dim).

    Whole blocks are copied as contiguous rows (index_select), several times faster than
    gathering slot by slot with advanced indexing."""
    num_slots, kv_heads, head_dim = cache.shape
    rows = cache.view(num_slots // block_size, block_size * kv_heads * head_dim)
    gathered = rows.index_select(0, block_ids.reshape(-1))
    return gathered.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, head_dim)


def native_decode_kernel(dtype: torch.dtype, head_dim: int, device: torch.device) -> DecodeKernel | None:
    """The C++ paged decode kernel when it is built and handles these caches, else None (torch path).

    It takes float32 or bfloat16 caches on the CPU, head_dim a multiple of 16 (up to 512)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or head_dim % 16 or head_dim > 512:
        return None
    ops = native.load("attention")
    return None if ops is None else ops.paged_decode_attention


def decode_attention(
    q: torch.Tensor,  # (Bd, heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # (heads,) float32 logits, one more softmax column each (None: none)
) -> torch.Tensor:
    """(Bd, heads, head_dim) in q's dtype."""
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    if meta.decode_kernel is not None:
        return meta.decode_kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                  meta.block_size, scale, meta.decode_prefix_leaders, meta.decode_prefix_lens,
                                  meta.window or 0, sinks)
    num_decodes, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    # GQA without copying K/V: the query heads sharing a KV head act as that head's query
    # "positions", none of them causal. (Bd, kv_heads, group, head_dim)
    dq = q.view(num_decodes, kv_heads, group, head_dim)
    # The sinks as the scores lay heads out: (kv_heads, group), broadcast over rows.
    head_sinks = None if sinks is None else sinks.view(kv_heads, group)
    mask: torch.Tensor | None = None
    if meta.decode_context is not None:  # one row, consecutive blocks: no copy, no mask
        length = meta.decode_context_len
        own_k = meta.decode_context.read(k_cache, meta.block_size)[:length].transpose(0, 1).unsqueeze(0)
        own_v = meta.decode_context.read(v_cache, meta.block_size)[:length].transpose(0, 1).unsqueeze(0)
    else:
        table, mask = meta.decode_block_table, meta.decode_mask
        assert table is not None and mask is not None, "the torch path's layout (runner._decode_layout)"
        own_k = gather_blocks(k_cache, table, meta.block_size).transpose(1, 2)  # (Bd, kv_heads, L, head_dim)
        own_v = gather_blocks(v_cache, table, meta.block_size).transpose(1, 2)
    if not meta.shared_prefixes:
        if head_sinks is None:
            out = F.scaled_dot_product_attention(dq, own_k, own_v, attn_mask=mask, scale=scale)
        else:
            out = attention_with_sinks(dq, own_k, own_v, mask, False, scale, head_sinks.unsqueeze(0))
        return out.reshape(num_decodes, num_heads, head_dim)
    assert mask is not None, "rows sharing a prefix are laid out in a padded table"

    # Scores in float32 whatever the cache holds (a bf16 matmul would round them to bf16).
    dq32 = dq.float() * scale
    own = torch.matmul(dq32, own_k.float().transpose(-1, -2))  # (Bd, kv_heads, group, L)
    own.masked_fill_(~mask, float("-inf"))
    shared_len = max(p.blocks.num_blocks for p in meta.shared_prefixes) * meta.block_size
    own_len = own.shape[-1]
    # [shared prefix (padded with -inf) | own keys | the sink, if any]
    width = shared_len + own_len + (head_sinks is not None)
    scores = torch.full((num_decodes, kv_heads, group, width), float("-inf"), device=q.device)
    scores[..., shared_len : shared_len + own_len] = own
    if head_sinks is not None:
        scores[..., -1] = head_sinks
    prefix_values = []
    for prefix in meta.shared_prefixes:
        rows, num_rows = prefix.rows, len(prefix.rows)
        pk = prefix.blocks.read(k_cache, meta.block_size).float()  # (P, kv_heads, head_dim)
        pv = prefix.blocks.read(v_cache, meta.block_size).float()
        length = pk.shape[0]
        # (kv_heads, rows * group, head_dim) x (kv_heads, head_dim, P): one matmul for the group.
        pq = dq32[rows].transpose(0, 1).reshape(kv_heads, num_rows * group, head_dim)
        prefix_scores = torch.matmul(pq, pk.permute(1, 2, 0))  # (kv_heads, rows * group, P)
        scores[rows, :, :, :length] = prefix_scores.view(kv_heads, num_rows, group, length).transpose(0, 1)
        prefix_values.append(pv)
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs[..., shared_len : shared_len + own_len], own_v.float())  # (Bd, kv_heads, group, head_dim)
    for prefix, pv in zip(meta.shared_prefixes, prefix_values):
        rows, num_rows, length = prefix.rows, len(prefix.rows), pv.shape[0]
        pp = probs[rows, :, :, :length].transpose(0, 1).reshape(kv_heads, num_rows * group, length)
        prefix_out = torch.matmul(pp, pv.transpose(0, 1))  # (kv_heads, rows * group, head_dim)
        out[rows] += prefix_out.view(kv_heads, num_rows, group, head_dim).transpose(0, 1)
    return out.reshape(num_decodes, num_heads, head_dim).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,  # (n, heads, head_dim)
    k: torch.Tensor,  # (n, kv_heads, head_dim): this chunk's fresh keys
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    block_size: int,
    scale: float,
    sinks: torch.Tensor | None = None,  # (heads,) float32 logits, one more softmax column each (None: none)
) -> torch.Tensor:
    """(n, heads, head_dim)."""
    if chunk.context is None:
        pk, pv = k, v
    else:
        pk = chunk.context.read(k_cache, block_size)[: chunk.context_len]
        pv = chunk.context.read(v_cache, block_size)[: chunk.context_len]
    bq = q.transpose(0, 1).unsqueeze(0)  # (1, heads, n, head_dim)
    bk = pk.transpose(0, 1).unsqueeze(0)  # (1, kv_heads, ctx, head_dim)
    bv = pv.transpose(0, 1).unsqueeze(0)
    causal = chunk.attn_mask is None
    if sinks is None:
        attn = F.scaled_dot_product_attention(bq, bk, bv, attn_mask=chunk.attn_mask, is_causal=causal, scale=scale,
                                              enable_gqa=True)
    else:
        head_sinks = sinks.to(device=q.device, dtype=torch.float32).view(1, -1, 1)  # (1, heads, 1)
        attn = attention_with_sinks(bq, bk, bv, chunk.attn_mask, causal, scale, head_sinks)
    return attn.squeeze(0).transpose(0, 1)


def attention_with_sinks(
    q: torch.Tensor,  # (B, heads, n, head_dim)
    k: torch.Tensor,  # (B, kv_heads, ctx, head_dim); heads a multiple of kv_heads (GQA)
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcast to (B, heads, n, ctx), True = may attend; None: see is_causal
    is_causal: bool,  # query i sees keys 0..i (n == ctx)
    scale: float,
    sinks: torch.Tensor,  # float32, broadcast to (B, heads, n)
) -> torch.Tensor:
    """SDPA whose every softmax has one more column, a sink: its logit, and a value of zero.
    (B, heads, n, head_dim) in q's dtype."""
    if q.device.type == "cpu":
        # The fused kernel F.scaled_dot_product_attention runs on the CPU, which also returns each
        # row's logsumexp of its scaled scores (float32). With Z = exp(lse), the keys' share of
        # the probability is Z / (Z + exp(sink)) = sigmoid(lse - sink). It takes a float mask.
        # The factor is rounded to the output's dtype: a bfloat16 output converted to float32 and
        # back costs 10x the multiply (55 ms against 5.6 for a 2k-token prompt's 64 heads).
        float_mask = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=float_mask, scale=scale)
        return out.mul_(torch.sigmoid(lse - sinks).unsqueeze(-1).to(out.dtype))
    return explicit_attention_with_sinks(q, k, v, mask, is_causal, scale, sinks)


def explicit_attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor,
    max_scores: int = MAX_EXPLICIT_SCORES,
) -> torch.Tensor:
    """attention_with_sinks from explicit float32 scores, blocks of queries whose scores stay
    within max_scores elements (any device)."""
    batch, num_heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    k32 = k.float().unsqueeze(2).transpose(-1, -2)  # (B, kv_heads, 1, head_dim, ctx)
    v32 = v.float().unsqueeze(2)  # (B, kv_heads, 1, ctx, head_dim)
    sinks = sinks.expand(batch, num_heads, num_queries).reshape(batch, kv_heads, group, num_queries)
    if is_causal:
        mask = torch.arange(num_keys, device=q.device) <= torch.arange(num_queries, device=q.device).unsqueeze(1)
    if mask is not None:  # as the scores lay heads out: (B or 1, kv_heads or 1, group or 1, n or 1, ctx)
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mask = mask.unflatten(1, (kv_heads, group) if mask.shape[1] > 1 else (1, 1))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block = max(1, max_scores // (batch * num_heads * max(1, num_keys)))
    for start in range(0, num_queries, block):
        rows = slice(start, min(num_queries, start + block))
        bq = q[:, :, rows].float().unflatten(1, (kv_heads, group)) * scale  # (B, kv_heads, group, rows, head_dim)
        scores = torch.matmul(bq, k32)  # (B, kv_heads, group, rows, ctx)
        if mask is not None:
            scores.masked_fill_(~(mask[..., rows, :] if mask.shape[-2] > 1 else mask), float("-inf"))
        sink = sinks[..., rows].unsqueeze(-1)  # (B, kv_heads, group, rows, 1)
        top = torch.maximum(scores.amax(-1, keepdim=True), sink)  # finite: a row with no key keeps its sink
        probs = torch.exp(scores - top)
        total = probs.sum(-1, keepdim=True) + torch.exp(sink - top)
        block_out = torch.matmul(probs, v32) / total  # (B, kv_heads, group, rows, head_dim)
        out[:, :, rows] = block_out.flatten(1, 2).to(q.dtype)
    return out
