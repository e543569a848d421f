"""context.least_true: the least n that fits, from any guess, for any monotone predicate."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenway.client.context import least_true


@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 45), st.integers(-5, 50))
def test_least_from_any_guess(lowest, span, threshold, guess):
    highest = lowest + span
    probed = []

    def fits(n):
        assert lowest <= n <= highest
        probed.append(n)
        return n >= threshold

    expected = max(lowest, threshold) if threshold <= highest else None
    assert least_true(fits, guess, lowest, highest) == expected
    assert len(probed) <= 2 * (span + 1).bit_length() + 2


def test_a_good_guess_costs_two_probes():
    probed = []
    assert least_true(lambda n: probed.append(n) or n >= 7, 7, 0, 40) == 7
    assert probed == [7, 6]
