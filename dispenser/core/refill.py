"""One tag's refill engine: when to fetch, how much to ask for, what to do with a range that arrives.

The worker's segment allocator (its source: the store) and the buffered client (its source: the workers)
both drive one; each only adds an async shell that performs the fetch. Pure: the caller passes the time.
The rules, and where the two shells' copies disagreed before, are in ``docs/segment.md`` ("The refill
engine").
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from dispenser.core.ids import IdBatch, Range
from dispenser.core.rate import RateMeter
from dispenser.core.segment import NEED_SEGMENT, NeedSegment, Segment, SegmentBuffer
from dispenser.core.step import FleetView, StepPolicy

__all__ = ["MIN_GAP", "Arrival", "Overlap", "Refill"]

MIN_GAP = 0.1
"""The shortest time (seconds) the IDs taken since the last fetch are divided by, to measure a rate."""


class Overlap(enum.Enum):
    """What an arriving range that lies at or below the IDs already installed means."""

    REFUSE = "refuse"
    """A fault (one store row grants increasing segments): :meth:`Refill.arrive` raises ``ValueError``."""
    SKIP = "skip"
    """Expected (several sources, each a segment of its own): the part at or below is dropped."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """What :meth:`Refill.arrive` did with a reply's ranges."""

    received: int
    """IDs in the ranges."""
    dropped: int
    """IDs skipped: at or below those installed before."""

    @property
    def admitted(self) -> int:
        """IDs installed."""
        return self.received - self.dropped


class Refill:
    """A tag's double buffer, its consumption meter, and the decisions of its single in-flight fetch.

    The shell's loop: :meth:`start` when :attr:`wants_fetch` (or when a take is short, after :meth:`need`);
    per attempt :meth:`size` then :meth:`attempt`; :meth:`arrive` with the reply, or :meth:`failed` (then
    :meth:`start` again to retry); after an arrival, :meth:`satisfied` says whether the fetch is over or,
    for a take that needs more, :meth:`again` starts the next one at once.

    Args:
        meter: the tag's rate meter (every take is counted in it).
        prefetch_threshold: see :class:`~dispenser.core.segment.SegmentBuffer`.
        min_gap: the shortest time (seconds) the rate since the last fetch is divided by.
        overlap: what an arriving range below the IDs installed means.
    """

    __slots__ = (
        "_mark_at",
        "_mark_issued",
        "behind",
        "buffer",
        "last_size",
        "meter",
        "min_gap",
        "overlap",
        "wanted",
    )

    def __init__(
        self,
        meter: RateMeter,
        *,
        prefetch_threshold: float = 0.0,
        min_gap: float = MIN_GAP,
        overlap: Overlap = Overlap.REFUSE,
    ) -> None:
        if min_gap <= 0:
            raise ValueError(f"min_gap must be positive, got {min_gap}")
        self.buffer = SegmentBuffer(prefetch_threshold)
        self.meter = meter
        self.min_gap = min_gap
        self.overlap = overlap
        self.wanted = 0
        self.behind = 0
        """With :attr:`Overlap.SKIP`: how far below the IDs held the last reply lay when all of it was skipped
        (0 otherwise). :meth:`size` asks for that much more, so that a source far behind is passed in one
        fetch, not a fetch per step (its skipped IDs are gaps, never repeats)."""
        """The most IDs a waiting take needs in hand (0: none waits); sizes the fetch."""
        self.last_size: int | None = None
        """The size of the last range that arrived (``None`` before the first)."""
        self._mark_at: float | None = None  # when the last attempt began (None: no measurement)
        self._mark_issued = 0  # meter.ids_issued then

    # -- handing out -------------------------------------------------------------------------------

    def take(self, count: int, now: float) -> IdBatch | NeedSegment:
        """``count`` IDs as one request, counted in the meter; :data:`NEED_SEGMENT` (nothing taken) if short."""
        batch = self.buffer.take(count)
        if batch is not NEED_SEGMENT:
            self.meter.record(now, count)
        return batch

    def take_run(self, limit: int, now: float) -> Range | NeedSegment:
        """Up to ``limit`` IDs of one segment for a cursor; each ID counts as one request (one call each)."""
        run = self.buffer.take_run(limit)
        if run is not NEED_SEGMENT:
            taken = run[1] - run[0] + 1
            self.meter.record(now, taken, taken)
        return run

    @property
    def wants_fetch(self) -> bool:
        """Whether a fetch should start now (the buffer's prefetch rule; false while one is in flight)."""
        return self.buffer.wants_fetch

    @property
    def remaining(self) -> int:
        """IDs in the buffer."""
        return self.buffer.remaining

    # -- sizing ------------------------------------------------------------------------------------

    def need(self, count: int) -> None:
        """A take of ``count`` found too few IDs and waits: the fetch must bring at least the shortfall."""
        self.wanted = max(self.wanted, count)

    def shortfall(self, outside: int = 0) -> int:
        """IDs a waiting take still misses (``outside``: IDs the shell holds outside the buffer, a cursor)."""
        return max(0, self.wanted - self.buffer.remaining - outside)

    def recent_rate(self, now: float) -> float:
        """IDs/s taken since the last attempt began (0 when not measured).

        A fetch starts when the current segment is first drawn from, so two attempts are about one
        segment's life apart: a rise in demand shows here at the next fetch, before any per-second average
        moves. The gap is counted as at least ``min_gap``: a burst never reads as more than the IDs it took
        spread over ``min_gap``.
        """
        if self._mark_at is None:
            return 0.0
        elapsed = max(now - self._mark_at, self.min_gap)
        return (self.meter.ids_issued - self._mark_issued) / elapsed

    def own_view(self, now: float) -> FleetView:
        """The meter as a fleet of one (a client, or a worker that knows no peers)."""
        rate = self.meter.rate(now)
        peak = self.meter.peak(now)
        return FleetView(
            own_rate=rate, own_peak=peak, fleet_rate=rate, fleet_peak=peak, recent=self.recent_rate(now)
        )

    def step(self, policy: StepPolicy, floor: int, view: FleetView) -> int:
        """The policy's size for the next range, from ``view`` and the last size."""
        return policy.next_step(floor, self.last_size, view)

    def size(self, step: int | None, *, outside: int = 0, cap: int | None = None) -> int | None:
        """What to ask for: ``step`` (the policy's), or more when a waiting take needs more; at most ``cap``.

        ``None`` when no step is known and no take waits (the source then grants its own default).
        """
        shortfall = self.shortfall(outside)
        size = shortfall if step is None else max(step, shortfall)
        if self.behind:
            size += self.behind
        if cap is not None:
            size = min(size, cap)
        return size or None

    # -- fetching ----------------------------------------------------------------------------------

    def start(self) -> None:
        """A fetch (or its retry) is now in flight."""
        self.buffer.begin_fetch()

    def attempt(self, now: float) -> None:
        """An attempt is sent now: the next fetch measures the rate from here.

        A retry moves the mark too, so an outage's wait is not counted as consumption.
        """
        self._mark_at = now
        self._mark_issued = self.meter.ids_issued

    def failed(self) -> None:
        """The attempt failed; the shell waits, then :meth:`start` again (or gives the fetch up)."""
        self.buffer.fetch_failed()

    def give_up(self) -> None:
        """The source refused for good: the fetch is over, and so is any take's wait."""
        self.buffer.fetch_failed()
        self.wanted = 0

    def arrive(self, ranges: Iterable[tuple[int, int]], now: float, *, asked: int) -> Arrival:
        """Install a reply's ranges (``asked``: the size requested, remembered for the step policy).

        Raises:
            ValueError: a range at or below the IDs installed, with :attr:`Overlap.REFUSE`: handing it out
                could repeat IDs. The fetch is over; nothing of that range was installed.
        """
        received = dropped = 0
        highest_skipped = None
        for first, last in ranges:
            segment = Segment(first, last)
            received += segment.size
            if self.overlap is Overlap.SKIP:
                part = self.buffer.admissible(segment)
                if part is None:
                    dropped += segment.size
                    highest_skipped = last if highest_skipped is None else max(highest_skipped, last)
                    continue
                dropped += part.first - first
                segment = part
            self.buffer.install(segment, now)  # ends the fetch; raises on overlap (REFUSE)
        # With nothing installed the buffer still counts the fetch in flight: the shell asks again.
        all_skipped = received > 0 and dropped == received
        self.behind = self.buffer.high - highest_skipped if all_skipped and highest_skipped is not None else 0
        self.last_size = asked
        return Arrival(received, dropped)

    def satisfied(self, outside: int = 0) -> bool:
        """After an arrival: whether every waiting take can now be served (the fetch is then over)."""
        if self.buffer.remaining + outside >= self.wanted:
            self.wanted = 0
            return True
        return False

    def again(self) -> None:
        """A take needs more than arrived: fetch again at once.

        That fetch is paced by the take, not by consumption, so it measures no rate.
        """
        self._mark_at = None
        if not self.buffer.fetching:
            self.buffer.begin_fetch()
