"""Paged decode attention: the C++ kernel and the torch path's shared-prefix (cascade) layout
both equal plain attention over each row's whole context, on random caches and on the real
model in mixed steps."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from tokenway import SamplingParams
from tokenway.models.attention import (
    AttentionMetadata,
    BlockRun,
    SharedPrefix,
    decode_attention,
    gather_blocks,
    native_decode_kernel,
)

BS = 4
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8


def reference_decode(q, k_cache, v_cache, tables, context_lens, scale, block_size=BS):
    """Each row on its own: its context gathered slot by slot, softmax in float64."""
    group = q.shape[1] // k_cache.shape[1]
    out = []
    for row, (table, length) in enumerate(zip(tables, context_lens)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # (L, heads, d)
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@contextlib.contextmanager
def torch_path(runner):
    """The runner laying decode attention out for the torch path (the native kernel off)."""
    kernel = runner.decode_kernel
    runner.decode_kernel = None
    try:
        yield runner
    finally:
        runner.decode_kernel = kernel


def native_kernel(dtype=torch.float32, head_dim=64):
    kernel = native_decode_kernel(dtype, head_dim, torch.device("cpu"))
    if kernel is None:
        pytest.skip("the native attention kernel does not build here")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_equals_attention_over_whole_contexts(dtype):
    """GQA groups, shuffled tables longer than the context, one long context (split into chunks
    and merged), a row of one token, a shared prefix, strided queries."""
    kernel = native_kernel(dtype)
    torch.manual_seed(3)
    block_size, num_blocks, kv_heads, heads, head_dim = 16, 160, 3, 9, 64
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    shared = [free.pop() for _ in range(4)]
    context_lens = [1, 37, 1500, 64 + 5, 64 + 30]
    tables = []
    for row, length in enumerate(context_lens):
        own = (length + block_size - 1) // block_size
        tables.append(shared + [free.pop() for _ in range(own - 4)] if row >= 3 else
                      [free.pop() for _ in range(own + 1)])  # one block more than it reads
    q = torch.randn(len(tables), heads, 2 * head_dim).to(dtype)[:, :, :head_dim]  # rows and heads strided
    scale = head_dim ** -0.5
    width = max(map(len, tables))
    got = kernel(q, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                 torch.tensor(context_lens, dtype=torch.int32), block_size, scale)
    expected = reference_decode(q.float(), k_cache.float(), v_cache.float(), tables, context_lens, scale, block_size)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_empty_context_reads_zeros(dtype):
    """A row with no context is zeros, whatever memory its output was given (the kernel writes
    the other rows whole and clears only the empty ones); calls in a row reuse freed buffers."""
    kernel = native_kernel(dtype)
    torch.manual_seed(4)
    block_size, kv_heads, heads, head_dim = 16, 2, 32, 64
    k_cache = torch.randn(8 * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(8 * block_size, kv_heads, head_dim).to(dtype)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    for _ in range(3):
        filler = torch.full((3, heads, head_dim), 7.0, dtype=dtype)  # leaves non-zero memory behind
        del filler
        q = torch.randn(3, heads, head_dim).to(dtype)
        got = kernel(q, k_cache, v_cache, tables, torch.tensor([20, 0, 5], dtype=torch.int32), block_size, 0.125)
        assert torch.count_nonzero(got[1]) == 0
        expected = reference_decode(q[[0, 2]].float(), k_cache.float(), v_cache.float(), [[0, 1], [4, 5]], [20, 5],
                                    0.125, block_size)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[[0, 2]].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 128)])
def test_native_cascade_equals_attention_over_whole_contexts(dtype, head_dim):
    """Two groups of rows behind shared prefixes (one of 20 rows: several blocks of queries, the
    prefix cut into chunks; one row whose whole context is the prefix), rows of their own, and
    the same call without the prefix arguments: all plain attention over each whole context."""
    kernel = native_kernel(dtype, head_dim)
    torch.manual_seed(5)
    block_size, num_blocks, kv_heads, heads = 16, 400, 3, 9
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    long_prefix, short_prefix = [free.pop() for _ in range(40)], [free.pop() for _ in range(3)]
    rng = random.Random(5)
    tables, context_lens, leaders, prefix_lens = [], [], [], []
    for row in range(26):
        if row in (0, 7):  # rows of their own
            prefix, leader = [], row
        elif row % 5 == 1:
            prefix, leader = short_prefix, 1
        else:
            prefix, leader = long_prefix, 2
        length = len(prefix) * block_size + (0 if row == 9 else rng.randint(1, 70))
        tables.append(prefix + [free.pop() for _ in range((length + block_size - 1) // block_size - len(prefix))])
        context_lens.append(length)
        leaders.append(leader)
        prefix_lens.append(len(prefix) * block_size)
    q = torch.randn(len(tables), heads, head_dim).to(dtype)
    width = max(map(len, tables))
    args = (q, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32), block_size, head_dim ** -0.5)
    got = kernel(*args, torch.tensor(leaders, dtype=torch.int32), torch.tensor(prefix_lens, dtype=torch.int32))
    expected = reference_decode(q.float(), k_cache.float(), v_cache.float(), tables, context_lens,
                                head_dim ** -0.5, block_size)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(kernel(*args).double(), expected, atol=tolerance, rtol=tolerance)


def test_native_kernel_refuses_a_prefix_its_rows_do_not_share():
    kernel = native_kernel()
    cache = torch.zeros(8 * 16, 1, 64)
    q = torch.zeros(2, 1, 64)
    tables = torch.tensor([[1, 2, 3], [1, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 40], dtype=torch.int32)

    def call(leaders, prefix_lens):
        kernel(q, cache, cache, tables, lens, 16, 1.0, torch.tensor(leaders, dtype=torch.int32),
               torch.tensor(prefix_lens, dtype=torch.int32))

    call([0, 0], [16, 16])  # block 1 is shared
    with pytest.raises(RuntimeError, match="does not hold its leader's prefix block 1"):
        call([0, 0], [32, 32])
    with pytest.raises(RuntimeError, match="whole blocks"):
        call([0, 0], [8, 8])
    with pytest.raises(RuntimeError, match="earlier row"):
        call([1, 1], [16, 16])
    with pytest.raises(RuntimeError, match="go together"):
        kernel(q, cache, cache, tables, lens, 16, 1.0, torch.tensor([0, 0], dtype=torch.int32), None)


def test_native_kernel_refuses_a_table_outside_the_cache():
    kernel = native_kernel()
    cache = torch.zeros(4 * 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="block_tables"):
        kernel(q, cache, cache, torch.tensor([[1, 9]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
               16, 1.0)
    with pytest.raises(RuntimeError, match="context_lens"):
        kernel(q, cache, cache, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([33], dtype=torch.int32),
               16, 1.0)


def layout(tables, context_lens, prefixes):
    """AttentionMetadata as the runner lays it out; prefixes: [(rows, num_blocks)]."""
    skip = [0] * len(tables)
    shared = []
    for rows, num_blocks in prefixes:
        shared.append(SharedPrefix(torch.tensor(rows), BlockRun.of(tables[rows[0]][:num_blocks], torch.device("cpu"))))
        for row in rows:
            skip[row] = num_blocks
    own = [t[s: (n + BS - 1) // BS] for t, s, n in zip(tables, skip, context_lens)]
    width = max(map(len, own))
    lens = torch.tensor([n - s * BS for n, s in zip(context_lens, skip)])
    mask = torch.arange(width * BS).unsqueeze(0) < lens.unsqueeze(1)
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS,
                             num_decode_tokens=len(tables),
                             decode_block_table=torch.tensor([t + [0] * (width - len(t)) for t in own]),
                             decode_mask=mask.view(len(tables), 1, 1, width * BS), shared_prefixes=shared)


@pytest.mark.parametrize("consecutive", [True, False])
def test_cascade_equals_attention_over_whole_contexts(consecutive):
    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 64
    k_cache = torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM)
    free = list(range(1, num_blocks))
    if not consecutive:
        rng.shuffle(free)
    prefix_a = [free.pop(0) for _ in range(5)]  # 3 rows share 5 blocks
    prefix_b = [free.pop(0) for _ in range(2)]  # 2 rows share 2 blocks
    tables, context_lens = [], []
    for prefix, extra_tokens in [(prefix_a, 3), (prefix_b, 9), (prefix_a, 1), ([], 30), (prefix_a, 14), (prefix_b, 4)]:
        own = [free.pop(0) for _ in range((extra_tokens + BS - 1) // BS)]
        tables.append(prefix + own)
        context_lens.append(len(prefix) * BS + extra_tokens)
    assert (BlockRun.of(prefix_a, torch.device("cpu")).first_block is not None) == consecutive
    q = torch.randn(len(tables), KV_HEADS * GROUP, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    expected = reference_decode(q, k_cache, v_cache, tables, context_lens, scale)

    plain = decode_attention(q, k_cache, v_cache, layout(tables, context_lens, []), scale)
    cascade = decode_attention(q, k_cache, v_cache, layout(tables, context_lens, [([0, 2, 4], 5), ([1, 5], 2)]), scale)
    torch.testing.assert_close(plain.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cascade.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_consecutive_block_run_is_read_without_a_copy():
    cache = torch.randn(10 * BS, KV_HEADS, HEAD_DIM)
    run = BlockRun.of([3, 4, 5], torch.device("cpu"))
    view = run.read(cache, BS)
    assert view.data_ptr() == cache[3 * BS].data_ptr()
    torch.testing.assert_close(view, gather_blocks(cache, torch.tensor([3, 4, 5]), BS))
    scattered = BlockRun.of([3, 5, 4], torch.device("cpu"))
    assert scattered.first_block is None
    torch.testing.assert_close(scattered.read(cache, BS), torch.cat([cache[12:16], cache[20:24], cache[16:20]]))


def test_cascade_and_native_in_the_engine_match_plain_attention_in_a_mixed_step(llm):
    """Rows sharing a 3-block prefix, rows sharing another of 2 blocks, a row sharing nothing and
    a prompt chunk in the same step: the step's logits are the same with and without cascade, and
    with the native kernel."""
    core = llm.engine
    runner, scheduler = core.runner, core.scheduler
    rng = random.Random(1)

    def tokens(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    system_a, system_b = tokens(3 * 16 + 5), tokens(2 * 16 + 9)
    warm = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": system_a + tokens(3)}, {"prompt_token_ids": system_b + tokens(3)}], warm)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [system_a + tokens(n) for n in (4, 20, 37)] + [system_b + tokens(n) for n in (2, 11)] + [tokens(45)]
    ids = [f"cascade-{i}" for i in range(len(prompts))]
    try:
        for request_id, prompt in zip(ids, prompts):
            core.add_request(request_id, prompt, params)
        while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                       for r in scheduler.requests.values()):
            core.step()
        for _ in range(3):
            core.step()
        assert {r.num_cached_tokens for r in scheduler.requests.values()} >= {48, 32}  # the prefix cache shared them
        core.add_request("cascade-prompt", tokens(70), params)
        ids.append("cascade-prompt")
        out = scheduler.schedule()
        assert sorted(out.num_scheduled_tokens)[-1] > 1 and out.num_scheduled_tokens.count(1) == len(prompts)
        native = runner.execute(out) if runner.decode_kernel is not None else None
        with torch_path(runner):
            runner.cascade_attention = False
            plain = runner.execute(out)
            runner.cascade_attention = True
            cascade = runner.execute(out)
        torch.testing.assert_close(cascade, plain, atol=2e-4, rtol=1e-4)
        assert cascade.argmax(-1).tolist() == plain.argmax(-1).tolist()
        if native is not None:
            torch.testing.assert_close(native, plain, atol=2e-4, rtol=1e-4)
            assert native.argmax(-1).tolist() == plain.argmax(-1).tolist()
        scheduler.update_from_output(out, plain.argmax(-1).tolist(), [None] * len(plain))
    finally:
        runner.cascade_attention = True
        core.abort_requests(ids)


def test_a_shared_prefix_is_laid_out_once_for_its_rows(llm):
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=16, num_decode_tokens=4)
    # rows 0, 1, 3 share blocks 7, 8 (block 9 only by rows 0 and 3, and row 3's newest token is in it).
    with torch_path(llm.engine.runner) as runner:
        runner._decode_layout(meta, [[7, 8, 9, 20], [7, 8, 30], [40, 41], [7, 8, 9]], [60, 40, 20, 33])
    assert len(meta.shared_prefixes) == 1
    prefix = meta.shared_prefixes[0]
    assert prefix.rows.tolist() == [0, 1, 3] and prefix.blocks.block_ids.tolist() == [7, 8]
    assert prefix.blocks.first_block == 7
    assert meta.decode_block_table.tolist() == [[9, 20], [30, 0], [40, 41], [9, 0]]
    assert meta.decode_mask.view(4, -1).sum(-1).tolist() == [60 - 32, 40 - 32, 20, 33 - 32]


def test_a_single_row_with_consecutive_blocks_reads_its_context_as_a_view(llm):
    torch.manual_seed(2)
    k_cache = torch.randn(40 * BS, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(40 * BS, KV_HEADS, HEAD_DIM)
    q = torch.randn(1, KV_HEADS * GROUP, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    table, length = [5, 6, 7, 8, 9], 18
    expected = reference_decode(q, k_cache, v_cache, [table], [length], scale)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS, num_decode_tokens=1,
                             decode_context=BlockRun.of(table, torch.device("cpu")), decode_context_len=length)
    torch.testing.assert_close(decode_attention(q, k_cache, v_cache, meta, scale).double(), expected,
                               atol=1e-5, rtol=1e-5)
    laid_out = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=16, num_decode_tokens=1)
    scattered = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=16, num_decode_tokens=1)
    with torch_path(llm.engine.runner) as runner:
        runner._decode_layout(laid_out, [[5, 6, 7, 8]], [60])
        runner._decode_layout(scattered, [[5, 7, 6, 8]], [60])
    assert laid_out.decode_context.first_block == 5 and laid_out.decode_context_len == 60
    assert scattered.decode_context is None and scattered.decode_block_table.tolist() == [[5, 7, 6, 8]]
