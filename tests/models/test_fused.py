"""The fused layer kernels (csrc/fused.cpp) against the torch operators they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenway import native
from tokenway.models.decoder import rotate_half

ops = native.load("fused")
pytestmark = pytest.mark.skipif(ops is None, reason="the native kernels do not build here")

HEADS, KV_HEADS, DIM = 6, 2, 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_equals_the_torch_path(dtype):
    torch.manual_seed(0)
    tokens, slots_total = 7, 40
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM)
    angles = torch.outer(torch.arange(100).float(), torch.rand(DIM // 2))
    cos_table, sin_table = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.tensor([0, 5, 6, 7, 50, 99, 3])
    slots = torch.tensor([3, 9, 10, 11, 30, 39, 0])
    k_cache = torch.zeros(slots_total, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros(slots_total, KV_HEADS, DIM, dtype=dtype)
    q = ops.rope_and_cache(qkv, cos_table, sin_table, positions, k_cache, v_cache, slots, HEADS, KV_HEADS)

    qk = qkv[:, : (HEADS + KV_HEADS) * DIM].view(tokens, HEADS + KV_HEADS, DIM)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    roped = (qk * cos + rotate_half(qk) * sin).to(dtype)
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert q.dtype == dtype and q.shape == (tokens, HEADS, DIM)
    torch.testing.assert_close(q, roped[:, :HEADS], **tolerance)
    torch.testing.assert_close(k_cache[slots], roped[:, HEADS:], **tolerance)
    torch.testing.assert_close(v_cache[slots], qkv[:, (HEADS + KV_HEADS) * DIM:].view(tokens, KV_HEADS, DIM).to(dtype))
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_rope_and_cache_refuses_slots_and_positions_out_of_range():
    qkv = torch.zeros(1, (HEADS + 2 * KV_HEADS) * DIM)
    table = torch.zeros(10, DIM)
    cache = torch.zeros(4, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="slot"):
        ops.rope_and_cache(qkv, table, table, torch.tensor([1]), cache, cache.clone(), torch.tensor([4]),
                           HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="position"):
        ops.rope_and_cache(qkv, table, table, torch.tensor([10]), cache, cache.clone(), torch.tensor([0]),
                           HEADS, KV_HEADS)


def test_add_rms_norm_and_silu_and_mul_equal_the_torch_operators():
    torch.manual_seed(1)
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (64,), weight, 1e-5)
    ops.add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(3, 2 * 40) * 4
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:],
                               atol=1e-6, rtol=1e-5)
    x = torch.randn(4, 576) * 3
    torch.testing.assert_close(ops.rms_norm(x, weight.repeat(9), 1e-6), F.rms_norm(x, (576,), weight.repeat(9), 1e-6),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 49157])
def test_argmax_rows_answers_as_torch(vocab):
    """The first of equal maxima, the first NaN, all -inf rows, tails past the last 16 values."""
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab)
    logits[1] = float("-inf")
    if vocab > 3:
        logits[2, [1, vocab - 2]] = 50.0  # a tie: the first wins
        logits[3, vocab - 1] = 50.0  # the maximum in the tail
        logits[4, [vocab // 2, vocab - 1]] = float("nan")  # the first NaN, as torch answers
        logits[5] = 0.0
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert ops.argmax_rows(torch.empty(0, vocab)).shape == (0,)
