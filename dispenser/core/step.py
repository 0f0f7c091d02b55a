"""How big the next segment should be: ``segment_seconds`` of this worker's share of the fleet's peak demand.

``target = segment_seconds x share x fleet_peak``, at least the current rate and the rate at which the last
segment went, clamped to [the configured step, ``max_step``], rounded up to three significant digits, kept
within a hysteresis band above the target. The rule and why: ``docs/operations.md`` ("The rule").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["Demand", "FleetView", "StepPolicy", "StepWhy", "round_step"]

StepWhy = Literal["floor", "cap", "kept", "sized"]
"""Why :meth:`StepPolicy.decide` chose its step: the configured step (the floor), ``max_step`` (the cap), the
previous step kept (within the hysteresis band), or a new size from the demand."""

Demand = Literal["share of the fleet peak", "own rate", "last segment's rate"]
"""Which measure of demand a step is sized for (see :meth:`StepPolicy.demand`)."""


def round_step(value: float) -> int:
    """``value`` rounded up to three significant digits (at least 1): never below ``value``."""
    if value <= 1:
        return 1
    digits = math.floor(math.log10(value)) - 2
    quantum: int = 10 ** max(digits, 0)
    return max(1, math.ceil(value / quantum) * quantum)


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the rate events say about one tag across the live workers (this one included)."""

    own_rate: float
    own_peak: float
    fleet_rate: float
    fleet_peak: float
    workers: int = 1
    recent: float = 0.0
    """IDs/s at which this worker's last segment went (a rise shows here first)."""
    remembered_peak: float = 0.0
    """The highest ``fleet_peak`` seen within the retention, saved across restarts
    (:class:`~dispenser.core.rate.FleetPeak`): it stands in for the peaks of workers that are gone."""

    def share(self) -> float:
        """This worker's part of the fleet's demand (0…1)."""
        if self.fleet_rate > 0:
            return min(1.0, self.own_rate / self.fleet_rate)
        if self.fleet_peak > 0:
            return min(1.0, self.own_peak / self.fleet_peak)
        return 1.0 / max(1, self.workers)


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """The rule above, with its settings."""

    segment_seconds: float = 600.0
    max_step: int = 100_000_000
    hysteresis: float = 0.25

    def demand(self, fleet: FleetView) -> tuple[float, Demand]:
        """The IDs/s a step is sized for, and which measure it is (the largest; on a tie, the first).

        This worker's share of the fleet's peak (or the remembered peak, if higher), its own current rate,
        or the rate at which its last segment went.
        """
        peak = max(fleet.fleet_peak, fleet.remembered_peak)
        measures: tuple[tuple[float, Demand], ...] = (
            (fleet.share() * peak, "share of the fleet peak"),
            (fleet.own_rate, "own rate"),
            (fleet.recent, "last segment's rate"),
        )
        return max(measures, key=lambda measure: measure[0])

    def target(self, fleet: FleetView) -> float:
        """The unclamped, unrounded size: ``segment_seconds`` of this worker's share of the demand."""
        return self.segment_seconds * self.demand(fleet)[0]

    def next_step(self, configured: int, current: int | None, fleet: FleetView) -> int:
        """The step of the next segment fetch.

        Args:
            configured: the tag's configured step (the floor).
            current: the step of the previous fetch (``None`` for the first).
            fleet: what the rate events say.
        """
        return self.decide(configured, current, fleet)[0]

    def decide(self, configured: int, current: int | None, fleet: FleetView) -> tuple[int, StepWhy]:
        """:meth:`next_step`, and why it is that size (the status page shows it)."""
        ceiling = max(configured, self.max_step)
        demand = self.target(fleet)
        target = min(max(demand, float(configured)), float(ceiling))
        if (
            current is not None
            and configured <= current <= ceiling
            and target <= current <= (1 + self.hysteresis) * target
        ):
            return current, "kept"
        # The band's middle, so that noise either way keeps it; rounded up, so never under the target.
        centred = round_step(math.sqrt(1 + self.hysteresis) * demand)
        if centred <= configured:
            return configured, "floor"
        if centred >= ceiling:
            return ceiling, "cap"
        return centred, "sized"
