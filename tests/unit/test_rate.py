"""The rate meter: exact rates for known load, the peak as the highest window average, restarts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispenser.core.rate import FleetPeak, PeakSample, RateMeter, runway_seconds


def drive(meter: RateMeter, start: float, seconds: int, per_second: int, requests: int = 10) -> float:
    """Issue ``per_second`` IDs (in ``requests`` requests) every second for ``seconds``; returns the end."""
    for second in range(seconds):
        for r in range(requests):
            meter.record(start + second + r / requests, per_second // requests)
    return start + seconds


@given(st.integers(1, 5000), st.integers(1, 30))
def test_a_constant_load_is_measured_exactly(per_second: int, window: int) -> None:
    """Constant load R: once a window has passed, rate and peak are R and requests/s is counted too."""
    meter = RateMeter(100.0, window=window)
    rate = (per_second // 10) * 10
    end = drive(meter, 100.0, window + 2, rate)
    assert meter.rate(end) == rate
    assert meter.peak(end) == rate
    assert meter.request_rate(end) == 10


def test_no_peak_before_a_whole_window() -> None:
    """A start-up burst shorter than the window does not pose as a peak."""
    meter = RateMeter(0.0, window=10)
    end = drive(meter, 0.0, 5, 10_000)
    assert meter.rate(end) == 10_000
    assert meter.peak(end) == 0.0


@given(st.lists(st.integers(0, 2000), min_size=1, max_size=40), st.integers(1, 8))
def test_the_peak_is_the_highest_window_average(loads: list[int], window: int) -> None:
    """For any per-second load, the peak is the maximum over all complete windows of their average."""
    meter = RateMeter(0.0, window=window)
    for second, ids in enumerate(loads):
        if ids:
            meter.record(second + 0.5, ids)
    end = float(len(loads))
    averages = [sum(loads[i - window : i]) / window for i in range(window, len(loads) + 1)]
    assert meter.peak(end) == pytest.approx(max(averages, default=0.0))


def test_idle_seconds_count_as_zero_and_the_rate_falls() -> None:
    """After the load stops the current rate falls to 0 while the peak stays."""
    meter = RateMeter(0.0, window=5)
    end = drive(meter, 0.0, 10, 1000)
    assert meter.rate(end + 100) == 0.0
    assert meter.peak(end + 100) == 1000


def test_the_peak_is_forgotten_after_the_retention() -> None:
    """A peak older than the retention no longer counts; a later, smaller one does."""
    meter = RateMeter(0.0, window=2, retention=50.0)
    end = drive(meter, 0.0, 5, 5000)
    end = drive(meter, end, 100, 100)
    assert meter.peak(end) == 100


def test_the_fleet_peak_outlives_the_workers_that_made_it() -> None:
    """The highest sum of peaks is remembered when the sum falls, for the retention after it was last seen."""
    fleet = FleetPeak(retention=100.0)
    assert fleet.update(0.0, 0.0) == 0.0
    assert fleet.update(3000.0, 10.0) == 3000.0  # two workers at 1,500
    assert fleet.update(1500.0, 20.0) == 3000.0  # one left: its demand moved to the other
    assert fleet.update(3000.0, 50.0) == 3000.0  # seen again: lives 100 s from here
    assert fleet.update(1000.0, 149.0) == 3000.0
    assert fleet.update(1000.0, 151.0) == 1000.0  # expired; the current sum is what is left


def test_a_saved_fleet_peak_is_taken_back_while_it_is_fresh() -> None:
    """Restore ignores a sample past the retention or not above the one held; a restored one expires too."""
    fleet = FleetPeak(retention=3600.0)
    fleet.restore(PeakSample(8000.0, 900.0), now=1000.0)
    assert fleet.update(10.0, 1000.0) == 8000.0
    fleet.restore(PeakSample(5000.0, 990.0), now=1000.0)
    snapshot = fleet.snapshot(1000.0)
    assert snapshot == PeakSample(8000.0, 900.0)
    assert fleet.snapshot(900.0 + 3601.0) is None
    stale = FleetPeak(retention=60.0)
    stale.restore(PeakSample(9000.0, 0.0), now=61.0)
    assert stale.snapshot(61.0) is None


def test_totals_and_runway() -> None:
    """Totals count every completed second; runway is buffered IDs over the rate."""
    meter = RateMeter(0.0, window=3)
    end = drive(meter, 0.0, 4, 100)
    meter.advance(end)
    assert meter.total_ids == 400
    assert meter.total_requests == 40
    assert runway_seconds(1000, 100.0) == 10.0
    assert runway_seconds(5, 0.0) == math.inf


def test_a_window_must_be_positive() -> None:
    """A zero window is refused."""
    with pytest.raises(ValueError, match="window"):
        RateMeter(0.0, window=0)
