"""The step policy: segments sized to segment_seconds of this worker's share of the fleet's peak."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.step import FleetView, StepPolicy, round_step

S = 5.0
policy = StepPolicy(segment_seconds=S, max_step=10_000_000, hysteresis=0.25)


def alone(rate: float, peak: float | None = None) -> FleetView:
    peak = rate if peak is None else peak
    return FleetView(own_rate=rate, own_peak=peak, fleet_rate=rate, fleet_peak=peak)


@given(st.floats(1.0, 1e9))
def test_rounding_is_up_to_three_significant_digits(value: float) -> None:
    """Rounded steps are never below the value, at most 1% above it, with at most three significant digits."""
    rounded = round_step(value)
    assert value <= rounded <= 1.01 * value + 1
    assert len(str(rounded).rstrip("0")) <= 3


@given(st.floats(10.0, 1e5))
def test_steady_load_sizes_at_s_times_r_and_at_most_a_quarter_more(rate: float) -> None:
    """One worker at R: after any history of steps, the step lands in [S x R, 1.25 x S x R]."""
    step = None
    for _ in range(3):
        step = policy.next_step(10, step, alone(rate))
    assert step is not None
    assert S * rate <= step <= 1.25 * S * rate


@given(st.floats(10.0, 1e5), st.integers(10, 10_000_000))
def test_a_leftover_step_is_kept_only_at_or_above_the_target(rate: float, current: int) -> None:
    """Whatever step the last fetch used, the next one is in [S x R, 1.25 x S x R]: never under the target.

    A kept step under the target is a segment that runs out before S seconds (the runway promise).
    """
    step = policy.next_step(10, current, alone(rate))
    target = max(S * rate, 10)
    assert target <= step <= 1.25 * target + 1


@given(st.floats(10.0, 1e5), st.lists(st.floats(-0.09, 0.09), min_size=5, max_size=20))
def test_noise_does_not_make_the_step_flap(rate: float, noise: list[float]) -> None:
    """±9% noise around a steady rate keeps the step it settled on (the band's middle, rounded up)."""
    step = policy.next_step(10, None, alone(rate))
    for jitter in noise:
        assert policy.next_step(10, step, alone(rate * (1 + jitter))) == step


@given(st.floats(10.0, 1e4))
def test_a_tenfold_rise_is_followed_at_the_next_fetch(rate: float) -> None:
    """R to 10 R: the recent rate lifts the step at the next fetch, before the peak has caught up."""
    step = policy.next_step(10, None, alone(rate))
    risen = FleetView(own_rate=10 * rate, own_peak=rate, fleet_rate=10 * rate, fleet_peak=rate)
    step = policy.next_step(10, step, risen)
    assert S * 10 * rate <= step <= 1.25 * S * 10 * rate


@given(st.integers(1, 10**7), st.floats(0, 1e7), st.integers(1, 10**7) | st.none())
def test_the_floor_and_the_ceiling_always_hold(configured: int, rate: float, current: int | None) -> None:
    """Never below the tag's configured step, never above max_step (unless the floor is higher)."""
    step = policy.next_step(configured, current, alone(rate))
    assert step >= configured
    assert step <= max(configured, policy.max_step)


def test_a_raised_floor_applies_at_once() -> None:
    """An operator raising leaf_alloc.step above the current step gets it at the next fetch."""
    step = policy.next_step(10, None, alone(100.0))
    assert step == 560  # 500 x sqrt(1.25), rounded up
    assert policy.next_step(600, step, alone(100.0)) == 600


@given(st.floats(100.0, 1e5), st.floats(0.1, 0.9))
def test_two_workers_size_to_their_shares(total: float, split: float) -> None:
    """Two workers sharing a tag: each sizes to its share; the sum is about S x the fleet's peak."""
    first = FleetView(
        own_rate=total * split, own_peak=total * split, fleet_rate=total, fleet_peak=total, workers=2
    )
    second = FleetView(
        own_rate=total * (1 - split),
        own_peak=total * (1 - split),
        fleet_rate=total,
        fleet_peak=total,
        workers=2,
    )
    steps = [policy.next_step(1, None, view) for view in (first, second)]
    assert S * total <= sum(steps) <= 1.25 * S * total + 2


def test_no_traffic_anywhere_splits_evenly_and_keeps_the_floor() -> None:
    """With no rate known, the share is 1/workers and the step is the configured one."""
    view = FleetView(own_rate=0.0, own_peak=0.0, fleet_rate=0.0, fleet_peak=0.0, workers=4)
    assert view.share() == 0.25
    assert policy.next_step(1000, None, view) == 1000
