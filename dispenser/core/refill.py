"""One tag's refill engine: when to fetch, how much to ask for, what to do with a range that arrives.

The worker's segment allocator (its source: the store) and the buffered client (its source: the workers)
each drive one through the same async shell, :class:`~dispenser.service.refiller.Refiller`. The engine
decides, the shell acts: :meth:`Refill.next` says what to fetch (or that nothing is in flight),
:meth:`Refill.on_reply` and :meth:`Refill.on_failure` what comes next, and a decision asked for out of
turn raises :class:`RefillOrderError`. Pure: the caller passes the time. The rules, and where the two
shells' copies disagreed before, are in ``docs/segment.md`` ("The refill engine").
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from dispenser.core.ids import IdBatch, Range
from dispenser.core.rate import RateMeter
from dispenser.core.segment import NEED_SEGMENT, NeedSegment, Segment, SegmentBuffer
from dispenser.core.step import FleetView, StepPolicy

__all__ = [
    "IDLE",
    "MIN_GAP",
    "RETRY",
    "SKIPS_BEFORE_PAUSE",
    "Again",
    "Arrival",
    "Done",
    "Fetch",
    "Idle",
    "Overlap",
    "Phase",
    "Refill",
    "RefillOrderError",
    "Retry",
    "Stop",
]

MIN_GAP = 0.1
"""The shortest time (seconds) the IDs taken since the last fetch are divided by, to measure a rate."""

SKIPS_BEFORE_PAUSE = 2
"""Replies in a row wholly below the IDs held after which the next attempt waits its back-off: not one
source behind another, but the tag's counter gone back (by hand?), which asking at once would not pass."""


class Overlap(enum.Enum):
    """What an arriving range that lies at or below the IDs already installed means."""

    REFUSE = "refuse"
    """A fault (one store row grants increasing segments): :meth:`Refill.on_reply` answers :class:`Stop`."""
    SKIP = "skip"
    """Expected (several sources, each a segment of its own): the part at or below is dropped."""


class Phase(enum.Enum):
    """Where the tag's single fetch stands; each decision is valid in some phases only."""

    IDLE = "idle"
    """No fetch: :meth:`Refill.begin` opens one."""
    DUE = "due"
    """A fetch is open and its next attempt not sent: :meth:`Refill.next` sends it."""
    SENT = "sent"
    """An attempt is out: :meth:`Refill.on_reply` or :meth:`Refill.on_failure` says how it went."""
    BACKING_OFF = "backing_off"
    """The last attempt failed: the shell waits its back-off, then :meth:`Refill.next` sends the retry."""


class RefillOrderError(RuntimeError):
    """A decision asked for in a phase where it has no meaning: a bug in the shell, never an outage."""

    def __init__(self, decision: str, phase: Phase) -> None:
        super().__init__(f"Refill.{decision}() in phase {phase.value!r}")


class Idle(enum.Enum):
    """Sentinel type: :meth:`Refill.next` has nothing to send (no fetch is open)."""

    IDLE = "IDLE"


IDLE = Idle.IDLE


@dataclass(frozen=True, slots=True)
class Fetch:
    """One attempt to send: ask the source for ``size`` IDs."""

    size: int | None
    """IDs to ask for (``None``: the source grants its own default)."""
    keep: int | None = None
    """The most IDs of the reply installed, the lowest admissible first (the rest is skipped: gaps, never
    repeats); ``None``: all. Below ``size`` when the size carries the gap to a source behind
    (:attr:`Refill.behind`): whichever source answers, no more than the fetch's own size is held."""
    repeat: bool = False
    """A retry that must ask exactly what the failed attempt asked (the same ``request_id``: the source
    may have granted it already and answers it again); see ``repeat_on_retry``."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """What :meth:`Refill.on_reply` did with a reply's ranges."""

    received: int
    """IDs in the ranges."""
    dropped: int
    """IDs skipped: at or below those installed before, or above what the fetch keeps (:attr:`trimmed`)."""
    trimmed: int = 0
    """Of :attr:`dropped`, IDs above the fetch's :attr:`~Fetch.keep`."""

    @property
    def admitted(self) -> int:
        """IDs installed."""
        return self.received - self.dropped


@dataclass(frozen=True, slots=True)
class Done:
    """The fetch is over: every waiting take can be served (the engine is idle)."""

    arrival: Arrival


@dataclass(frozen=True, slots=True)
class Again:
    """Fetch again at once (the shell calls :meth:`Refill.next`): a take needs more, or nothing was admitted."""

    arrival: Arrival
    skipped_in_a_row: int = 0
    """Replies in a row of which nothing was admitted (0 when this one was)."""

    @property
    def pause(self) -> bool:
        """Whether the shell waits its back-off first (more than :data:`SKIPS_BEFORE_PAUSE` skipped)."""
        return self.skipped_in_a_row > SKIPS_BEFORE_PAUSE


@dataclass(frozen=True, slots=True)
class Stop:
    """The fetch is over and nothing of the reply is served; waiting takes stop waiting (the engine is idle)."""

    reason: str


class Retry(enum.Enum):
    """Sentinel type: the attempt failed; after the shell's back-off, :meth:`Refill.next` sends the retry."""

    RETRY = "RETRY"


RETRY = Retry.RETRY


def _no_step() -> int | None:
    return None


class Refill:
    """A tag's double buffer, its consumption meter, and the decisions of its single in-flight fetch.

    The shell's loop (:class:`~dispenser.service.refiller.Refiller` is the one)::

        refill.begin()  # when wants_fetch, or a take found too few IDs (after need())
        while (fetch := refill.next(now, step)) is not IDLE:
            try:
                ranges = await source.fetch(fetch)
            except Refused:
                refill.on_failure(final=True)  # Stop: the loop ends
            except Exception:
                refill.on_failure()  # RETRY: wait the back-off
            else:
                refill.on_reply(ranges, now)  # Done (the loop ends), Again, or Stop

    Args:
        meter: the tag's rate meter (every take is counted in it).
        prefetch_threshold: see :class:`~dispenser.core.segment.SegmentBuffer`.
        min_gap: the shortest time (seconds) the rate since the last fetch is divided by.
        overlap: what an arriving range below the IDs installed means.
        cap: the most IDs one attempt asks for (the source's limit; ``None``: none).
        repeat_on_retry: a retry asks exactly what the failed attempt asked (the client: its request_id
            is answered again by the fleet) instead of being sized anew (the worker: the store keeps no
            record of a failed attempt).
    """

    __slots__ = (
        "_fetch",
        "_mark_at",
        "_mark_issued",
        "_skipped",
        "behind",
        "buffer",
        "cap",
        "last_size",
        "meter",
        "min_gap",
        "overlap",
        "phase",
        "repeat_on_retry",
        "wanted",
    )

    def __init__(
        self,
        meter: RateMeter,
        *,
        prefetch_threshold: float = 0.0,
        min_gap: float = MIN_GAP,
        overlap: Overlap = Overlap.REFUSE,
        cap: int | None = None,
        repeat_on_retry: bool = False,
    ) -> None:
        if min_gap <= 0:
            raise ValueError(f"min_gap must be positive, got {min_gap}")
        if cap is not None and cap < 1:
            raise ValueError(f"cap must be at least 1, got {cap}")
        self.buffer = SegmentBuffer(prefetch_threshold)
        self.meter = meter
        self.min_gap = min_gap
        self.overlap = overlap
        self.cap = cap
        self.repeat_on_retry = repeat_on_retry
        self.phase = Phase.IDLE
        """Where the single fetch stands."""
        self.wanted = 0
        """The most IDs a waiting take needs in hand (0: none waits); sizes the fetch."""
        self.behind = 0
        """With :attr:`Overlap.SKIP`: how far below the IDs held the last reply lay when all of it was skipped
        (0 otherwise). The next fetch asks for that much more, so that a source far behind is passed in one
        fetch, not a fetch per step (its skipped IDs are gaps, never repeats). Only the part a fetch would
        ask for without the gap is kept (:attr:`Fetch.keep`): the source ahead may answer it."""
        self.last_size: int | None = None
        """The size of the last range that arrived (``None`` before the first)."""
        self._fetch: Fetch | None = None  # the attempt out, or the one that failed last
        self._skipped = 0  # replies in a row wholly below the IDs held
        self._mark_at: float | None = None  # when the last attempt began (None: no measurement)
        self._mark_issued = 0  # meter.ids_issued then

    # -- handing out -------------------------------------------------------------------------------

    def take(self, count: int, now: float) -> IdBatch | NeedSegment:
        """``count`` IDs as one request, counted in the meter; :data:`NEED_SEGMENT` (nothing taken) if short."""
        batch = self.buffer.take(count)
        if batch is not NEED_SEGMENT:
            self.meter.record(now, count)
        return batch

    def take_within(self, count: int, now: float) -> Range | None:
        """:meth:`take` as one range when the current segment holds it all; ``None`` (nothing taken) else."""
        run = self.buffer.take_within(count)
        if run is not None:
            self.meter.record(now, count)
        return run

    def take_run(self, limit: int, now: float) -> Range | NeedSegment:
        """Up to ``limit`` IDs of one segment for a cursor; each ID counts as one request (one call each)."""
        run = self.buffer.take_run(limit)
        if run is not NEED_SEGMENT:
            taken = run[1] - run[0] + 1
            self.meter.record(now, taken, taken)
        return run

    @property
    def wants_fetch(self) -> bool:
        """Whether a fetch should begin now (the buffer's prefetch rule; false while one is in flight)."""
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
        """What to ask for: ``step`` (the policy's) or a waiting take's shortfall, plus :attr:`behind`; at most ``cap``.

        ``None`` when no step is known and no take waits (the source then grants its own default).
        """
        kept = self._kept(step, outside)
        size = kept + self.behind
        if cap is not None:
            size = min(size, cap)
        return size or None

    def _sized(self, step: int | None, outside: int) -> Fetch:
        """A fresh attempt's size and, with several sources, what of its reply is kept (without the gap)."""
        size = self.size(step, outside=outside, cap=self.cap)
        if self.overlap is Overlap.REFUSE or size is None:
            return Fetch(size)
        # The gap (behind) is asked for so that a source far behind is passed in one request; if the source
        # ahead answers, all of it lies above the IDs held. Holding it would be holding the gap: seconds or
        # minutes of IDs instead of buffer_seconds (issue 30). Only the size without the gap is kept.
        kept = self._kept(step, outside)
        return Fetch(size, min(size, kept) if kept else None)

    def _kept(self, step: int | None, outside: int) -> int:
        shortfall = self.shortfall(outside)
        return shortfall if step is None else max(step, shortfall)

    # -- deciding ----------------------------------------------------------------------------------

    def begin(self) -> None:
        """Open the single fetch (``wants_fetch``, or a take that found too few IDs, after :meth:`need`).

        Raises:
            RefillOrderError: a fetch is open already.
        """
        if self.phase is not Phase.IDLE:
            raise RefillOrderError("begin", self.phase)
        self.buffer.begin_fetch()
        self.phase = Phase.DUE
        self._skipped = 0
        self._fetch = None

    def next(
        self, now: float, step: Callable[[], int | None] = _no_step, *, outside: int = 0
    ) -> Fetch | Idle:
        """The attempt to send now, or :data:`IDLE` when no fetch is open (the shell's loop ends).

        Args:
            now: the time; the next fetch measures the rate from here. A retry moves the mark too, so
                an outage's wait is not counted as consumption.
            step: the policy's step, asked only when a fresh size is needed (``None``: the source's own).
            outside: IDs the shell holds outside the buffer (the client's cursor).

        Raises:
            RefillOrderError: an attempt is out (its reply or failure comes first).
        """
        phase = self.phase
        if phase is Phase.IDLE:
            return IDLE
        if phase is Phase.SENT:
            raise RefillOrderError("next", phase)
        if phase is Phase.BACKING_OFF:
            self.buffer.begin_fetch()
        failed = self._fetch
        if phase is Phase.BACKING_OFF and self.repeat_on_retry and failed is not None:
            fetch = failed if failed.repeat else replace(failed, repeat=True)
        else:
            fetch = self._sized(step(), outside)
        self._fetch = fetch
        self._mark_at = now
        self._mark_issued = self.meter.ids_issued
        self.phase = Phase.SENT
        return fetch

    def on_reply(
        self, ranges: Iterable[tuple[int, int]], now: float, *, outside: int = 0
    ) -> Done | Again | Stop:
        """Install a reply's ranges and say what comes next.

        Args:
            ranges: the reply's, increasing.
            now: the time.
            outside: IDs the shell holds outside the buffer (the client's cursor).

        Returns:
            :class:`Done` when every waiting take can be served; :class:`Again` when a take needs more, or
            nothing was admitted (all below the IDs held, with :attr:`Overlap.SKIP`); :class:`Stop` for a
            range at or below the IDs installed with :attr:`Overlap.REFUSE` (handing it out could repeat
            IDs; nothing of the reply is installed).

        Raises:
            RefillOrderError: no attempt is out.
        """
        if self.phase is not Phase.SENT:
            raise RefillOrderError("on_reply", self.phase)
        fetch = self._fetch
        assert fetch is not None  # sent
        try:
            arrival = self._install(ranges, now, fetch.keep)
        except ValueError as exc:
            self.wanted = 0
            self.phase = Phase.IDLE
            return Stop(str(exc))
        if arrival.admitted == 0:
            # Nothing installed: the buffer still counts the fetch in flight; ask again.
            self._skipped += 1
            self.phase = Phase.DUE
            return Again(arrival, self._skipped)
        self._skipped = 0
        # The policy's hysteresis compares the next step with this: the size meant, not the gap asked on top.
        self.last_size = fetch.keep or fetch.size or arrival.received
        if self.buffer.remaining + outside >= self.wanted:
            self.wanted = 0
            self.phase = Phase.IDLE
            return Done(arrival)
        # A take needs more than arrived: that fetch is paced by the take, not by consumption, so it
        # measures no rate.
        self._mark_at = None
        self.buffer.begin_fetch()
        self.phase = Phase.DUE
        return Again(arrival)

    def on_failure(self, *, final: bool = False) -> Retry | Stop:
        """The attempt failed: :data:`RETRY` after the shell's back-off, or :class:`Stop` when ``final``.

        ``final``: the source refused for good; the fetch is over, and so is every take's wait.

        Raises:
            RefillOrderError: no attempt is out.
        """
        if self.phase is not Phase.SENT:
            raise RefillOrderError("on_failure", self.phase)
        self.buffer.fetch_failed()
        if final:
            self.wanted = 0
            self.phase = Phase.IDLE
            return Stop("refused")
        self.phase = Phase.BACKING_OFF
        return RETRY

    def abandon(self) -> None:
        """The shell gives the open fetch up (it stopped, or failed itself): the engine is idle again."""
        if self.phase is Phase.IDLE:
            return
        if self.buffer.fetching:
            self.buffer.fetch_failed()
        self.phase = Phase.IDLE

    def _install(self, ranges: Iterable[tuple[int, int]], now: float, keep: int | None) -> Arrival:
        """Install what is admissible of ``ranges``, at most ``keep`` IDs (raises ``ValueError``, REFUSE overlap)."""
        received = dropped = trimmed = 0
        highest_skipped = None
        room = keep
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
            if room is not None:
                if segment.size > room:  # above what the fetch keeps: skipped, a gap like a source behind
                    trimmed += segment.size - room
                    if room == 0:
                        continue
                    segment = Segment(segment.first, segment.first + room - 1)
                room -= segment.size
            self.buffer.install(segment, now)  # ends the fetch; raises on overlap (REFUSE)
        all_skipped = received > 0 and dropped == received
        self.behind = self.buffer.high - highest_skipped if all_skipped and highest_skipped is not None else 0
        return Arrival(received, dropped + trimmed, trimmed)
