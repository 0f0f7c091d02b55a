"""Consumption rate of one tag on one worker: IDs and requests per second, and the peak that sizes segments.

Pure: the caller passes the time (monotonic seconds) into every call; counting is two additions on the
hot path. What is measured and why: ``docs/operations.md`` ("The rule").
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

__all__ = ["FleetPeak", "PeakSample", "RateMeter", "runway_seconds"]


@dataclass(frozen=True, slots=True)
class PeakSample:
    """A peak rate (IDs per second) and the monotonic-or-wall time it was seen at (the caller's clock)."""

    rate: float
    at: float


class RateMeter:
    """IDs and requests issued per second for one tag, with the current and the peak rate.

    Each second, once a whole window has been seen, gives a *window average* (the sliding
    ``window``-second mean). With ``sustain`` n ≥ 1 a *peak candidate* is the lowest of the last
    n x ``window`` window averages: the rate held throughout, so IDs drawn within any (n - 1) x ``window``
    consecutive seconds cannot raise it (each such burst leaves one of those averages untouched), and a
    steady load counts in full once held (n + 1) x ``window`` - 1 seconds. With ``sustain`` 0 a candidate is
    the window average itself. The peak is the highest candidate within the retention.

    Args:
        now: the time the meter starts (seconds).
        window: seconds averaged for the current rate and for each peak candidate (default 60: the
            peak is the highest 1-minute average).
        retention: seconds a peak is remembered (default 24 h).
        sustain: windows over which a peak candidate must hold (default 0: a single window average).
    """

    __slots__ = (
        "_buckets",
        "_filled",
        "_hold",
        "_ids",
        "_lows",
        "_peaks",
        "_requests",
        "_second",
        "_sum_ids",
        "_sum_requests",
        "retention",
        "sustain",
        "total_ids",
        "total_requests",
        "window",
    )

    def __init__(
        self, now: float, *, window: int = 60, retention: float = 86_400.0, sustain: int = 0
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 second, got {window}")
        if sustain < 0:
            raise ValueError(f"sustain must be at least 0 windows, got {sustain}")
        self.window = window
        self.retention = retention
        self.sustain = sustain
        self._hold = max(1, sustain * window)  # window averages a candidate is the minimum of
        self._second = math.floor(now)
        self._ids = 0
        self._requests = 0
        self._buckets: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
        self._sum_ids = 0
        self._sum_requests = 0
        self._filled = 0  # completed seconds observed since the start (for "a whole window seen")
        self._peaks: collections.deque[PeakSample] = collections.deque()  # decreasing rates, increasing times
        # The last ``_hold`` window averages' sliding minimum: increasing rates, increasing times.
        self._lows: collections.deque[PeakSample] = collections.deque()
        self.total_ids = 0
        self.total_requests = 0

    def record(self, now: float, ids: int, requests: int = 1) -> None:
        """Count ``ids`` IDs handed out in ``requests`` requests at ``now``."""
        if now >= self._second + 1:
            self._advance(math.floor(now))
        self._ids += ids
        self._requests += requests

    def _advance(self, second: int) -> None:
        """Close the current second (and any idle seconds after it) and start ``second``."""
        gap = second - self._second
        self._push(self._ids, self._requests, self._second + 1)
        # Idle seconds count as zeros; more than a window of them leaves the window all zeros.
        for offset in range(1, min(gap, self.window + 1)):
            self._push(0, 0, self._second + 1 + offset)
        if gap > self.window + 1:
            self._filled += gap - self.window - 1
            # The window averages skipped were zeros: the latest stands for them all in the minimum.
            self._average(0.0, float(second))
        self._second = second
        self._ids = 0
        self._requests = 0

    def _push(self, ids: int, requests: int, end: int) -> None:
        buckets = self._buckets
        if len(buckets) == self.window:
            old_ids, old_requests = buckets[0]
            self._sum_ids -= old_ids
            self._sum_requests -= old_requests
        buckets.append((ids, requests))
        self._sum_ids += ids
        self._sum_requests += requests
        self.total_ids += ids
        self.total_requests += requests
        self._filled += 1
        if self._filled >= self.window:
            self._average(self._sum_ids / self.window, float(end))

    def _average(self, rate: float, end: float) -> None:
        """Take the window average ending at ``end``; offer the lowest of the last ``_hold`` as a candidate."""
        lows = self._lows
        while lows and lows[-1].rate >= rate:
            lows.pop()
        lows.append(PeakSample(rate, end))
        while lows[0].at <= end - self._hold:
            lows.popleft()
        if self._filled - self.window + 1 >= self._hold:  # that many window averages seen
            self._offer(PeakSample(lows[0].rate, end))

    def _offer(self, sample: PeakSample) -> None:
        peaks = self._peaks
        while peaks and peaks[-1].rate <= sample.rate:
            peaks.pop()
        peaks.append(sample)
        self._expire(sample.at)

    def _expire(self, now: float) -> None:
        peaks = self._peaks
        while peaks and peaks[0].at < now - self.retention:
            peaks.popleft()

    @property
    def ids_issued(self) -> int:
        """Every ID counted so far, the current second included (for counters such as Prometheus')."""
        return self.total_ids + self._ids

    @property
    def requests_issued(self) -> int:
        """Every request counted so far, the current second included."""
        return self.total_requests + self._requests

    def advance(self, now: float) -> None:
        """Bring the buckets up to ``now`` without counting anything (call before reading on a timer)."""
        if now >= self._second + 1:
            self._advance(math.floor(now))

    def rate(self, now: float) -> float:
        """IDs per second over the completed seconds of the window (0 before the first one completes)."""
        self.advance(now)
        if not self._buckets:
            return 0.0
        return self._sum_ids / len(self._buckets)

    def request_rate(self, now: float) -> float:
        """Requests per second over the completed seconds of the window."""
        self.advance(now)
        if not self._buckets:
            return 0.0
        return self._sum_requests / len(self._buckets)

    def peak(self, now: float) -> float:
        """The highest peak candidate seen within the retention (0 if none yet): see the class."""
        self.advance(now)
        self._expire(now)
        return self._peaks[0].rate if self._peaks else 0.0


class FleetPeak:
    """The highest fleet-wide peak (IDs/s, the sum of the live workers' peaks) seen within ``retention``.

    Each worker's own peak is its own meter's; their sum falls when a worker goes (its events stop), yet
    the demand it served did not go away: it moved to the survivors. So the fleet's peak is remembered
    here, per tag, for as long as a worker's own peak would be, and saved for the next start.

    Args:
        retention: seconds a peak is remembered after it was last seen (default 24 h).
    """

    __slots__ = ("_sample", "retention")

    def __init__(self, retention: float = 86_400.0) -> None:
        self.retention = retention
        self._sample: PeakSample | None = None

    def update(self, measured: float, now: float) -> float:
        """Take the fleet's current sum of peaks; return the remembered peak (at least ``measured``)."""
        sample = self.snapshot(now)
        if measured > 0 and (sample is None or measured >= sample.rate):
            # Seen again now: it lives ``retention`` from here (the workers' own peaks expire by themselves,
            # and the sum with them).
            self._sample = sample = PeakSample(measured, now)
        return sample.rate if sample is not None else 0.0

    def snapshot(self, now: float) -> PeakSample | None:
        """The remembered peak and when it was last seen; ``None`` without one (or once expired)."""
        if self._sample is not None and self._sample.at < now - self.retention:
            self._sample = None
        return self._sample

    def restore(self, sample: PeakSample, now: float) -> None:
        """Take back a saved peak (ignored if already older than the retention, or not above ours)."""
        if sample.at < now - self.retention:
            return
        current = self.snapshot(now)
        if current is None or sample.rate > current.rate:
            self._sample = sample


def runway_seconds(ids_left: int, rate: float) -> float:
    """How long ``ids_left`` buffered IDs last at ``rate`` IDs/s (``inf`` at rate 0)."""
    if rate <= 0:
        return math.inf
    return ids_left / rate
