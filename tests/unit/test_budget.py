"""The per-caller ID budget (dispenser/core/budget.py): token buckets on a clock the test holds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.budget import IdBudget


def test_a_caller_takes_its_burst_then_its_rate() -> None:
    """5,000 at once, then nothing more until the rate has refilled it; the wait says when."""
    budget = IdBudget(rate=1000, burst=5000)
    assert budget.charge("a", 5000, now=0.0) == 0.0
    assert budget.charge("a", 1, now=0.0) == pytest.approx(0.001)
    assert budget.charge("a", 2000, now=1.0) == pytest.approx(1.0)  # 1,000 refilled, 2,000 asked
    assert budget.charge("a", 2000, now=2.0) == 0.0
    assert budget.charge("b", 5000, now=2.0) == 0.0  # another caller: a budget of its own


def test_a_request_over_the_burst_is_never_granted() -> None:
    """More than the bucket holds: an infinite wait, and nothing taken."""
    budget = IdBudget(rate=10, burst=100)
    assert budget.charge("a", 101, now=0.0) == math.inf
    assert budget.charge("a", 100, now=0.0) == 0.0


def test_callers_are_bounded_and_full_buckets_go_first() -> None:
    """Past max_callers, a caller whose bucket has refilled is forgotten before one still paying."""
    budget = IdBudget(rate=1, burst=10, max_callers=2)
    budget.charge("paying", 10, now=0.0)
    budget.charge("idle", 1, now=0.0)
    budget.charge("new", 1, now=5.0)  # "idle" is full again at 5 s, "paying" is not
    assert len(budget) == 2
    assert budget.charge("paying", 10, now=5.0) > 0  # still remembered: still paying
    budget.charge("newer", 1, now=5.0)  # nobody full: the oldest goes
    assert len(budget) == 2


@given(
    rate=st.floats(1, 1e6),
    burst=st.integers(1, 10**7),
    asks=st.lists(st.tuples(st.floats(0, 10), st.integers(1, 10**7)), max_size=60),
)
def test_no_caller_gets_more_than_its_burst_plus_its_rate_over_time(
    rate: float, burst: int, asks: list[tuple[float, int]]
) -> None:
    """Over any requests at any times, what is granted by time t is at most burst + rate x t."""
    budget = IdBudget(rate, burst)
    now, granted = 0.0, 0
    for gap, count in asks:
        now += gap
        if budget.charge("a", count, now) == 0.0:
            granted += count
        assert granted <= burst + rate * now + 1e-6 * (burst + rate * now)


@given(rate=st.floats(1, 1e6), burst=st.integers(1, 10**6), count=st.integers(1, 10**6))
def test_a_refusal_says_how_long_until_the_same_request_is_granted(
    rate: float, burst: int, count: int
) -> None:
    """Retrying after the wait it was told succeeds (when the request fits the burst at all)."""
    budget = IdBudget(rate, burst)
    budget.charge("a", burst, 0.0)
    wait = budget.charge("a", count, 0.0)
    if count > burst:
        assert wait == math.inf
    else:
        assert budget.charge("a", count, wait * (1 + 1e-9) + 1e-9) == 0.0
