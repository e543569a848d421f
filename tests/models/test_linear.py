"""Linear kernels: oneDNN's packed layout computes the same product as torch's default, the
choice is per weight shape, and a packed weight keeps no plain copy."""

from __future__ import annotations

import pytest
import torch

from tokenway.config import EngineConfig
from tokenway.models.linear import LinearKernel, onednn_available, select_kernels

pytestmark = pytest.mark.skipif(not onednn_available(torch.empty(1, 1)), reason="this torch has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 70])
def test_packed_equals_default(bias, tokens):
    torch.manual_seed(0)
    weight, b = torch.randn(96, 64), torch.randn(96) if bias else None
    x = torch.randn(tokens, 64)
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    default = LinearKernel(torch.nn.Parameter(weight.clone(), requires_grad=False),
                           None if b is None else torch.nn.Parameter(b.clone(), requires_grad=False))
    packed = LinearKernel(torch.nn.Parameter(weight.clone(), requires_grad=False),
                          None if b is None else torch.nn.Parameter(b.clone(), requires_grad=False))
    packed.pack()
    assert packed.backend == "onednn" and default.backend == "default"
    assert packed.weight.numel() == 0  # the plain copy is released
    for kernel in (default, packed):
        out = kernel(x)
        assert out.dtype == torch.float32 and out.shape == (tokens, 96)
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 16, 17, 70])
def test_bf16_rows_padded_to_a_bucket_give_the_unpadded_product(tokens):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16(), torch.randn(tokens, 64)
    out = LinearKernel(weight, bias)(x)
    assert out.dtype == torch.float32 and out.shape == (tokens, 96)
    torch.testing.assert_close(out, torch.nn.functional.linear(x.bfloat16(), weight, bias).float())


def test_modes_choose_per_shape_and_skip_what_onednn_cannot_take():
    def kernels():
        return [LinearKernel(torch.nn.Parameter(torch.randn(*shape, dtype=dtype), requires_grad=False))
                for shape, dtype in [((64, 32), torch.float32), ((64, 32), torch.float32), ((32, 64), torch.bfloat16)]]

    default = kernels()
    assert select_kernels(default, "default") == {(64, 32): "default", (32, 64): "default"}
    assert all(k.backend == "default" for k in default)
    forced = kernels()
    assert select_kernels(forced, "onednn") == {(64, 32): "onednn", (32, 64): "default"}  # bf16 stays
    assert [k.backend for k in forced] == ["onednn", "onednn", "default"]
    measured = kernels()
    chosen = select_kernels(measured, "auto")
    assert [k.backend for k in measured[:2]] == [chosen[(64, 32)]] * 2  # one choice per shape


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="linear_kernels: must be auto, default or onednn"):
        EngineConfig(linear_kernels="fast")
