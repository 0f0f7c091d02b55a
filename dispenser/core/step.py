"""How big the next segment should be: ``segment_seconds`` of this worker's share of the fleet's peak demand.

Leaf sizes steps by segment age alone: double when a segment lasted under 15 minutes, halve past 30, cap at
1,000,000. That reacts a segment late in both directions and knows nothing of the peak. Meituan's own advice
is a segment of 600 * the tag's peak QPS, so that with the database down the double buffer keeps issuing
for 10 to 20 minutes at the busiest time. We size from measured demand:

    target = segment_seconds * share * fleet_peak

* ``fleet_peak`` is the sum of the live workers' peak rates for the tag (each from its rate events), or
  the highest such sum seen within the retention if that is more (workers that went left their demand
  to the others; a restarted fleet of any size starts from it);
* ``share`` is this worker's part of the fleet's *current* rate (how the queue group or consumer group
  spreads the load now); with no current traffic anywhere it falls back to its part of the peaks, and
  with nothing known to ``1 / workers``. For one worker, target = segment_seconds * its own peak;
* the demand used is at least the worker's current rate and the rate at which its last segment went
  (segment size over the time between two fetches), so a sudden rise is followed at the next fetch, before
  the peak (a window average) has caught up;
* clamped to [the tag's configured step (the operator's floor, Leaf's ``leaf_alloc.step``), ``max_step``],
  rounded *up* to three significant digits (steps read like 118,000, not 117,384);
* never under the target: the runway promise is that a worker at steady peak load holds at least
  ``segment_seconds`` of IDs at every moment, and with the next segment fetched at the switch
  (:class:`~dispenser.core.segment.SegmentBuffer`) the least it holds is one whole segment. So the
  current step is kept while it stays within [target, ``(1 + hysteresis) x`` target], and a new step is
  ``sqrt(1 + hysteresis) x target`` rounded up, the band's middle on a log scale: the target may then move
  by about ±``hysteresis / 2`` (-9.7% to +11.8% for 25%) before the step changes, so noise in the
  measured rate does not make every segment a different size, and a kept step is never below its target
  (nor more than ``hysteresis`` above it: the band is measured from the target). A raised floor or lowered
  ceiling applies at once; a ceiling under the target is the one case where a segment holds less.

The policy never touches IDs: the store still grants one ``UPDATE … RETURNING`` per segment of whatever
size is asked, so a step change can neither lose nor repeat an ID.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FleetView", "StepPolicy", "round_step"]


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

    def target(self, fleet: FleetView) -> float:
        """The unclamped, unrounded size: ``segment_seconds`` of this worker's share of the demand."""
        peak = max(fleet.fleet_peak, fleet.remembered_peak)
        demand = max(fleet.share() * peak, fleet.own_rate, fleet.recent)
        return self.segment_seconds * demand

    def next_step(self, configured: int, current: int | None, fleet: FleetView) -> int:
        """The step of the next segment fetch.

        Args:
            configured: the tag's configured step (the floor).
            current: the step of the previous fetch (``None`` for the first).
            fleet: what the rate events say.
        """
        ceiling = max(configured, self.max_step)
        demand = self.target(fleet)
        target = min(max(demand, float(configured)), float(ceiling))
        if (
            current is not None
            and configured <= current <= ceiling
            and target <= current <= (1 + self.hysteresis) * target
        ):
            return current
        # The band's middle, so that noise either way keeps it; rounded up, so never under the target.
        centred = round_step(math.sqrt(1 + self.hysteresis) * demand)
        return min(max(centred, configured), ceiling)
