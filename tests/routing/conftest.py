"""Shared by the routing tests: a clock the test moves by hand."""

from __future__ import annotations

import pytest


class FakeClock:
    """A monotonic clock that only moves when told: breakers and cooldowns without sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()
