"""Why a step is that size (the status page's "why"): the reason :meth:`StepPolicy.decide` gives is true."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.step import FleetView, StepPolicy

policy = StepPolicy(segment_seconds=5.0, max_step=1_000_000, hysteresis=0.25)

rates = st.floats(0.0, 1e7, allow_nan=False)
views = st.builds(
    FleetView,
    own_rate=rates,
    own_peak=rates,
    fleet_rate=rates,
    fleet_peak=rates,
    workers=st.integers(1, 5),
    recent=rates,
    remembered_peak=rates,
)


@given(st.integers(1, 2_000_000), st.none() | st.integers(1, 3_000_000), views)
def test_the_reason_says_where_the_step_came_from(
    configured: int, current: int | None, view: FleetView
) -> None:
    """floor: the configured step; cap: max_step (or the configured step above it); kept: the previous step; sized: strictly between."""
    step, why = policy.decide(configured, current, view)
    assert step == policy.next_step(configured, current, view)
    ceiling = max(configured, policy.max_step)
    if why == "floor":
        assert step == configured
    elif why == "cap":
        assert step == ceiling
    elif why == "kept":
        assert step == current
    else:
        assert configured < step < ceiling


def test_the_demand_names_the_largest_measure() -> None:
    """The step is sized for the largest of the share of the fleet peak, the own rate, the last segment's rate."""
    shared = FleetView(own_rate=10, own_peak=10, fleet_rate=20, fleet_peak=100, workers=2)
    assert policy.demand(shared) == (50.0, "share of the fleet peak")
    rising = FleetView(own_rate=80, own_peak=10, fleet_rate=80, fleet_peak=10)
    assert policy.demand(rising) == (80.0, "own rate")
    burst = FleetView(own_rate=1, own_peak=1, fleet_rate=1, fleet_peak=1, recent=300)
    assert policy.demand(burst) == (300.0, "last segment's rate")
