"""The helper threads the block kernels and decode attention run their chunks on (csrc/pool.h):
every chunk runs once, on any number of threads, concurrent callers each get their own product,
and a forked child, which has none of its parent's helpers, still computes."""

from __future__ import annotations

import os
import threading
import time

import gguf  # a dependency of tokenway itself (models/quant.py imports it)
import numpy as np
import pytest
import torch

from tokenway.models import quant

# Any build: the vector paths' chunks and the plain-C++ one's rows run on the pool alike.
pytestmark = pytest.mark.skipif(quant._ops() is None, reason="the quant kernel does not build here")

ROWS, COLS = 4096, 512  # 256 groups of 16 rows: many chunks


@pytest.fixture(scope="module")
def kernel() -> quant.QuantKernel:
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_0)
    return quant.QuantKernel(torch.from_numpy(blocks), "Q4_0", COLS)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1 + i % 3, COLS, generator=generator) for i in range(count)]


def test_every_row_is_computed_once_on_any_number_of_threads(kernel, threads):
    x = inputs(1)[0]
    torch.set_num_threads(1)
    alone = kernel(x)
    # Not a product of zeros or of a few rows: the float product of the same weights.
    assert torch.allclose(alone, x @ kernel.dequantize().T, rtol=1e-4, atol=1e-4)
    for num_threads in (2, 3, 4):  # more threads than cores too: helpers that start late
        torch.set_num_threads(num_threads)
        for _ in range(20):
            assert torch.equal(kernel(x), alone)


def test_concurrent_callers_each_get_their_own_product(kernel, threads):
    torch.set_num_threads(2)
    xs = inputs(8)
    want = [kernel(x) for x in xs]
    failures: list[str] = []

    def call(first: int) -> None:
        for i in range(40):
            index = (first + i) % len(xs)
            if not torch.equal(kernel(xs[index]), want[index]):
                failures.append(f"caller {first}, input {index}")

    callers = [threading.Thread(target=call, args=(first,)) for first in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_computes_without_its_parents_helpers(kernel, threads):
    torch.set_num_threads(2)
    x = inputs(1)[0]
    want = kernel(x)  # the parent's helpers are running now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its product is the parent's
        try:
            os._exit(0 if all(torch.equal(kernel(x), want) for _ in range(5)) else 1)
        except BaseException:  # noqa: BLE001 - the child must exit, never return into pytest
            os._exit(2)
    deadline = time.monotonic() + 120  # a bound on a hang, not a speed
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0
