"""Attention sinks (gpt-oss): one more softmax column per query head, a learned logit whose value
vector is zero. Every attention path given sinks equals a plain float64 reference with that
column: the native paged decode kernel (every instruction set it builds for here), the torch
decode paths (a single row's view, a padded table, shared prefixes) and prefill."""

from __future__ import annotations

import random

import pytest
import torch

from tokenway import native
from tokenway.models.attention import (
    AttentionMetadata,
    BlockRun,
    PrefillChunk,
    SharedPrefix,
    attention_with_sinks,
    decode_attention,
    explicit_attention_with_sinks,
    prefill_attention,
)

ISAS = [None, "avx2", "scalar"]
CPU = torch.device("cpu")


def make_sinks(heads: int, seed: int) -> torch.Tensor:
    """Sinks around the scores' size, one far above every score (its rows ~0) and one far below
    (no effect): (heads,) float32."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    return sinks


def softmax_with_sink(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """scores (heads, *, keys) float64 -> the keys' probabilities, the sink's column dropped."""
    sink = sinks.double().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1]


def reference_decode(q, k_cache, v_cache, tables, context_lens, scale, block_size, sinks, window=None):
    """Each row on its own: the keys it sees (its last `window`) gathered slot by slot, float64."""
    group = q.shape[1] // k_cache.shape[1]
    out = []
    for row, (table, length) in enumerate(zip(tables, context_lens)):
        first = 0 if window is None else max(0, length - window)
        positions = torch.arange(first, length)
        slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # (L, heads, d)
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
        out.append(torch.einsum("hl,lhd->hd", softmax_with_sink(scores, sinks), v))
    return torch.stack(out)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    value = 1e-5 if dtype == torch.float32 else 2e-2
    return {"atol": value, "rtol": value}


def kernel_for(isa: str | None, dtype: torch.dtype, head_dim: int):
    if native.process_isa() != "native" and isa is None:
        pytest.skip("the process builds for another instruction set")
    ops = native.load("attention", isa)
    if ops is None:
        pytest.skip(f"no {isa or 'native'} build of the attention kernel on this machine")
    return ops.paged_decode_attention


# ---- The native kernel ----

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 48)])
def test_native_kernel_with_sinks_equals_attention_with_the_extra_column(isa, dtype, head_dim):
    """GQA (groups of 5), an empty context (zeros), a row of one token, a short row (one segment
    written out), a long one (cut into chunks and merged), two groups behind shared prefixes (one
    of 12 rows: several blocks of queries) and a row that is all prefix, with no window and with a
    window that some rows are past; and the same call without sinks is attention without them."""
    kernel = kernel_for(isa, dtype, head_dim)
    torch.manual_seed(11)
    block_size, num_blocks, kv_heads, heads = 16, 400, 2, 10
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    long_prefix, short_prefix = [free.pop() for _ in range(12)], [free.pop() for _ in range(3)]
    rng = random.Random(11)
    tables, context_lens, leaders, prefix_lens = [], [], [], []
    for row, (prefix, leader, extra) in enumerate(
            [([], 0, 0), ([], 1, 1), ([], 2, 37), ([], 3, 1500), (short_prefix, 4, 5), (short_prefix, 4, 0)]
            + [(long_prefix, 6, rng.randint(1, 150)) for _ in range(12)]):
        length = len(prefix) * block_size + extra
        tables.append(prefix + [free.pop() for _ in range((length + block_size - 1) // block_size - len(prefix))])
        context_lens.append(length)
        leaders.append(leader if prefix else row)
        prefix_lens.append(len(prefix) * block_size)
    q = torch.randn(len(tables), heads, 2 * head_dim).to(dtype)[:, :, :head_dim]  # rows and heads strided
    scale = head_dim ** -0.5
    sinks = make_sinks(heads, 11)
    width = max(map(len, tables))
    args = (q, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32), block_size, scale,
            torch.tensor(leaders, dtype=torch.int32), torch.tensor(prefix_lens, dtype=torch.int32))
    floats = (q.float(), k_cache.float(), v_cache.float(), tables, context_lens, scale, block_size)
    for window in (None, 128):
        got = kernel(*args, window or 0, sinks)
        assert got.dtype == dtype and got.shape == q.shape
        assert torch.count_nonzero(got[0]) == 0
        expected = reference_decode(*floats, sinks, window)
        torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
        assert got[:, 0].abs().max() < 1e-6  # the sink far above every score takes all the probability
    plain = reference_decode(*floats, torch.full((heads,), -torch.inf))
    torch.testing.assert_close(kernel(*args).double(), plain, **tolerance(dtype))


def test_native_kernel_refuses_sinks_of_another_shape():
    kernel = kernel_for(None, torch.float32, 64)
    cache = torch.zeros(4 * 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    call = (q, cache, cache, torch.tensor([[1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 16, 1.0,
            None, None, 0)
    kernel(*call, torch.zeros(4))
    for bad in (torch.zeros(2), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(1, 4)):
        with pytest.raises(RuntimeError, match="sinks"):
            kernel(*call, bad)


def test_decode_attention_hands_sinks_to_the_native_kernel():
    """decode_attention passes sinks (in any float dtype) on through the metadata's kernel."""
    kernel = kernel_for(None, torch.float32, 64)
    torch.manual_seed(12)
    k_cache, v_cache = torch.randn(8 * 16, 2, 64), torch.randn(8 * 16, 2, 64)
    q = torch.randn(2, 8, 64)
    sinks = make_sinks(8, 12)
    tables = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=16, num_decode_tokens=2,
                             decode_kernel=kernel, decode_block_tables=tables,
                             decode_context_lens=torch.tensor([30, 9], dtype=torch.int32))
    expected = reference_decode(q, k_cache, v_cache, [[3, 1], [5]], [30, 9], 0.125, 16, sinks)
    torch.testing.assert_close(decode_attention(q, k_cache, v_cache, meta, 0.125, sinks).double(), expected,
                               **tolerance(torch.float32))
    torch.testing.assert_close(decode_attention(q, k_cache, v_cache, meta, 0.125, sinks.double()).double(),
                               expected, **tolerance(torch.float32))


# ---- The torch decode paths ----

BS = 4


def torch_layout(tables, context_lens, prefixes, window=None):
    """AttentionMetadata as the runner lays out the torch path; prefixes: [(rows, num_blocks)]
    (no window). A row's blocks before its window are not read."""
    skip = [0 if window is None else max(0, n - window) // BS for n in context_lens]
    shared = []
    for rows, num_blocks in prefixes:
        shared.append(SharedPrefix(torch.tensor(rows), BlockRun.of(tables[rows[0]][:num_blocks], CPU)))
        for row in rows:
            skip[row] = num_blocks
    own = [t[s: (n + BS - 1) // BS] for t, s, n in zip(tables, skip, context_lens)]
    own_lens = torch.tensor([n - s * BS for n, s in zip(context_lens, skip)])
    width = max(map(len, own))
    key_pos = torch.arange(width * BS).unsqueeze(0)
    mask = key_pos < own_lens.unsqueeze(1)
    if window is not None:
        mask &= key_pos >= (own_lens - window).clamp(min=0).unsqueeze(1)
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS,
                             num_decode_tokens=len(tables),
                             decode_block_table=torch.tensor([t + [0] * (width - len(t)) for t in own]),
                             decode_mask=mask.view(len(tables), 1, 1, width * BS), shared_prefixes=shared,
                             window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_decode_paths_with_sinks_equal_attention_with_the_extra_column(dtype):
    """A padded table, the same rows behind two shared prefixes, the padded table under a window
    (rows past it), and a single row read as a view: GQA, bfloat16 and float32 caches."""
    torch.manual_seed(13)
    kv_heads, heads, head_dim, num_blocks = 2, 6, 16, 64
    k_cache = torch.randn(num_blocks * BS, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * BS, kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks - 1).add(1).tolist()
    prefix_a, prefix_b = [free.pop() for _ in range(5)], [free.pop() for _ in range(2)]
    tables, context_lens = [], []
    for prefix, extra in [(prefix_a, 3), (prefix_b, 9), (prefix_a, 1), ([], 30), (prefix_a, 14), (prefix_b, 4)]:
        tables.append(prefix + [free.pop() for _ in range((extra + BS - 1) // BS)])
        context_lens.append(len(prefix) * BS + extra)
    q = torch.randn(len(tables), heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    sinks = make_sinks(heads, 13)
    floats = (q.float(), k_cache.float(), v_cache.float())
    layouts = {None: [torch_layout(tables, context_lens, []),
                      torch_layout(tables, context_lens, [([0, 2, 4], 5), ([1, 5], 2)])],
               10: [torch_layout(tables, context_lens, [], window=10)]}
    for window, metas in layouts.items():
        expected = reference_decode(*floats, tables, context_lens, scale, BS, sinks, window)
        for meta in metas:
            got = decode_attention(q, k_cache, v_cache, meta, scale, sinks)
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
    table = [40, 41, 42, 43, 44]
    view = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS, num_decode_tokens=1,
                             decode_context=BlockRun.of(table, CPU), decode_context_len=18)
    got = decode_attention(q[:1], k_cache, v_cache, view, scale, sinks)
    expected = reference_decode(*floats, [table], [18], scale, BS, sinks)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))


# ---- Prefill, and the two ways SDPA is given sinks ----

def reference_prefill(q, k, v, mask, scale, sinks):
    """(n, heads, d) queries over (ctx, kv_heads, d) keys where mask (n, ctx) allows, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnc,chd->nhd", softmax_with_sink(scores, sinks), v)


def causal_window_mask(num_queries: int, query_start: int, key_start: int, num_keys: int, window: int | None):
    query_pos = torch.arange(query_start, query_start + num_queries).unsqueeze(1)
    key_pos = torch.arange(key_start, key_start + num_keys).unsqueeze(0)
    mask = key_pos <= query_pos
    return mask if window is None else mask & (key_pos > query_pos - window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_sinks_equals_attention_with_the_extra_column(dtype):
    """A whole prompt (causal), the same prompt past a window (its fresh keys, masked), and a later
    chunk reading its cached context through scattered blocks under a window: GQA."""
    torch.manual_seed(14)
    kv_heads, heads, head_dim, block_size = 2, 8, 32, 16
    sinks = make_sinks(heads, 14)
    scale = head_dim ** -0.5
    n = 150
    q = torch.randn(n, heads, head_dim).to(dtype)
    k = torch.randn(n, kv_heads, head_dim).to(dtype)
    v = torch.randn(n, kv_heads, head_dim).to(dtype)
    floats = (q.float(), k.float(), v.float())
    empty = torch.empty(0, kv_heads, head_dim, dtype=dtype)
    whole = PrefillChunk(0, n, n, None, None)
    got = prefill_attention(q, k, v, empty, empty, whole, block_size, scale, sinks)
    assert got.dtype == dtype and got.shape == q.shape
    expected = reference_prefill(*floats, causal_window_mask(n, 0, 0, n, None), scale, sinks)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
    windowed = PrefillChunk(0, n, n, None, causal_window_mask(n, 0, 0, n, 40))
    got = prefill_attention(q, k, v, empty, empty, windowed, block_size, scale, sinks)
    expected = reference_prefill(*floats, causal_window_mask(n, 0, 0, n, 40), scale, sinks)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))

    # A chunk of 30 new tokens at positions 200..229: keys from block (200 - 40 + 1) // 16 = 10 on.
    num_blocks, start, window = 20, 200, 40
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    block_ids = torch.randperm(num_blocks).tolist()[: (start + 30 + block_size - 1) // block_size]
    first_block = (start - window + 1) // block_size
    context = BlockRun.of(block_ids[first_block:], CPU)
    context_len = start + 30 - first_block * block_size
    mask = causal_window_mask(30, start, first_block * block_size, context_len, window)
    chunk = PrefillChunk(0, 30, context_len, context, mask)
    got = prefill_attention(q[:30], k[:30], v[:30], k_cache, v_cache, chunk, block_size, scale, sinks)
    ck, cv = context.read(k_cache, block_size)[:context_len], context.read(v_cache, block_size)[:context_len]
    expected = reference_prefill(q[:30].float(), ck.float(), cv.float(), mask, scale, sinks)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attend", [attention_with_sinks, explicit_attention_with_sinks])
def test_both_ways_of_adding_sinks_equal_the_reference(attend, dtype):
    """The fused kernel's logsumexp (CPU) and explicit scores (elsewhere; here in blocks of 7
    queries), on prefill's layout (causal, a mask) and decode's (query heads as positions, a
    padded mask per row, a row that sees no key: zeros)."""
    torch.manual_seed(15)
    kv_heads, group, head_dim = 2, 4, 16
    sinks = make_sinks(kv_heads * group, 15)
    scale = head_dim ** -0.5
    blocks = {} if attend is attention_with_sinks else {"max_scores": 7 * kv_heads * group * 40}
    q = torch.randn(1, kv_heads * group, 40, head_dim).to(dtype)
    k = torch.randn(1, kv_heads, 40, head_dim).to(dtype)
    v = torch.randn(1, kv_heads, 40, head_dim).to(dtype)
    flat = (q[0].transpose(0, 1).float(), k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float())
    causal = causal_window_mask(40, 0, 0, 40, None)
    got = attend(q, k, v, None, True, scale, sinks.view(1, -1, 1), **blocks)
    expected = reference_prefill(*flat, causal, scale, sinks).transpose(0, 1).unsqueeze(0)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
    windowed = causal_window_mask(40, 0, 0, 40, 9)
    got = attend(q, k, v, windowed, False, scale, sinks.view(1, -1, 1), **blocks)
    expected = reference_prefill(*flat, windowed, scale, sinks).transpose(0, 1).unsqueeze(0)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))

    # Decode's layout: 3 rows, (rows, kv_heads, group, d) queries over (rows, kv_heads, L, d) keys.
    dq = torch.randn(3, kv_heads, group, head_dim).to(dtype)
    dk = torch.randn(3, kv_heads, 12, head_dim).to(dtype)
    dv = torch.randn(3, kv_heads, 12, head_dim).to(dtype)
    lens = torch.tensor([12, 5, 0])
    mask = (torch.arange(12).unsqueeze(0) < lens.unsqueeze(1)).view(3, 1, 1, 12)
    got = attend(dq, dk, dv, mask, False, scale, sinks.view(1, kv_heads, group), **blocks)
    for row in range(2):
        length = int(lens[row])
        expected = reference_prefill(dq[row].reshape(1, -1, head_dim).float(),
                                     dk[row, :, :length].transpose(0, 1).float(),
                                     dv[row, :, :length].transpose(0, 1).float(),
                                     torch.ones(1, length, dtype=torch.bool), scale, sinks)
        torch.testing.assert_close(got[row].reshape(1, -1, head_dim).double(), expected, **tolerance(dtype))
    assert torch.count_nonzero(got[2]) == 0
