"""Segments and Leaf's double buffer for one tag: which IDs to hand out, and when to fetch more.

Everything that decides an ID lives here: a :class:`SegmentBuffer` hands each ID of its installed
segments out once, in increasing order, all-or-nothing per take. Pure: no I/O, no clock. The rules:
``docs/segment.md`` ("The double buffer").
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

from dispenser.core.ids import IdBatch, Range

__all__ = [
    "NEED_SEGMENT",
    "BufferStats",
    "NeedSegment",
    "Segment",
    "SegmentBuffer",
    "SegmentStats",
]

"""An inclusive range of IDs, ``(first, last)``."""


@dataclass(frozen=True, slots=True)
class Segment:
    """An inclusive range of IDs granted by the store: ``[first, last]``."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if self.first > self.last:
            raise ValueError(f"empty segment [{self.first}, {self.last}]")
        if self.first < 0:
            raise ValueError(f"segment [{self.first}, {self.last}] holds negative IDs")

    @property
    def size(self) -> int:
        """How many IDs the segment holds."""
        return self.last - self.first + 1

    @classmethod
    def from_max_id(cls, max_id: int, step: int) -> Segment:
        """The segment Leaf's ``UPDATE … SET max_id = max_id + step RETURNING max_id`` grants."""
        return cls(max_id - step, max_id - 1)


class NeedSegment(enum.Enum):
    """Sentinel type: the buffer cannot serve the take until another segment is installed."""

    NEED_SEGMENT = "NEED_SEGMENT"


NEED_SEGMENT = NeedSegment.NEED_SEGMENT


@dataclass(frozen=True, slots=True)
class SegmentStats:
    """One buffered segment as monitoring sees it."""

    first: int
    last: int
    position: int
    """The next ID this segment would hand out (``last + 1`` when used up)."""
    remaining: int


@dataclass(frozen=True, slots=True)
class BufferStats:
    """A snapshot of one tag's double buffer, for monitoring and the rate events."""

    current: SegmentStats | None
    next: tuple[SegmentStats, ...]
    remaining: int
    fetching: bool
    fetches: int
    failed_fetches: int
    last_install_at: float | None
    prefetch_threshold: float


class SegmentBuffer:
    """The double buffer of one tag. Pure: no I/O, no clock; the shell drives it."""

    def __init__(self, prefetch_threshold: float = 0.0) -> None:
        """Create an empty buffer.

        Args:
            prefetch_threshold: fraction of the current segment that, once used, makes the buffer
                want the next segment. ``0.0`` (the default) fetches at the switch, as soon as one ID of
                a new current segment is used, so that one whole segment beyond the current is in hand
                at every moment but the fetch's round trip. Leaf uses 10%, which leaves only 0.9 of a
                segment in hand just before its prefetch.
        """
        if not 0.0 <= prefetch_threshold <= 1.0:
            raise ValueError(f"prefetch_threshold must be within [0, 1], got {prefetch_threshold}")
        self.prefetch_threshold = prefetch_threshold
        self._current: Segment | None = None
        self._position = 0  # next ID of the current segment
        # wants_fetch's threshold as a position, computed once per segment rather than on every take:
        # more than prefetch_threshold of the current segment is used once _position > _fetch_at.
        self._fetch_at = -1
        self._queue: deque[Segment] = deque()
        self._available = 0  # IDs left in current + queue, kept so take() need not add them up
        self._high = -1  # last ID of the newest installed segment: installs must lie above it
        self._fetching = False
        self._fetches = 0
        self._failed_fetches = 0
        self._last_install_at: float | None = None

    # -- reading ---------------------------------------------------------------------------------

    @property
    def remaining(self) -> int:
        """IDs buffered and not yet handed out, across all installed segments."""
        return self._available

    @property
    def high(self) -> int:
        """The last ID of the newest installed segment (-1 before the first install)."""
        return self._high

    @property
    def fetching(self) -> bool:
        """Whether a fetch is in flight (between :meth:`begin_fetch` and install/failure)."""
        return self._fetching

    @property
    def wants_fetch(self) -> bool:
        """Whether the shell should start a background fetch now.

        True when nothing is in flight, no further segment is buffered, and either there is no
        current segment or more than ``prefetch_threshold`` of it is used.
        """
        return not self._fetching and not self._queue and self._position > self._fetch_at

    def shortfall(self, count: int) -> int:
        """How many IDs are missing to serve a take of ``count`` (0 when it can be served)."""
        return max(0, count - self._available)

    def stats(self) -> BufferStats:
        """A snapshot for monitoring: both segments' bounds, position, fetch state."""
        current = None
        if self._current is not None:
            c = self._current
            current = SegmentStats(c.first, c.last, self._position, c.last - self._position + 1)
        queued = tuple(SegmentStats(s.first, s.last, s.first, s.size) for s in self._queue)
        return BufferStats(
            current=current,
            next=queued,
            remaining=self._available,
            fetching=self._fetching,
            fetches=self._fetches,
            failed_fetches=self._failed_fetches,
            last_install_at=self._last_install_at,
            prefetch_threshold=self.prefetch_threshold,
        )

    # -- deciding --------------------------------------------------------------------------------

    def take(self, count: int) -> IdBatch | NeedSegment:
        """Hand out ``count`` IDs, or :data:`NEED_SEGMENT` (consuming nothing) if too few are buffered."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if count > self._available:
            return NEED_SEGMENT
        current = self._current
        assert current is not None  # _available > 0 implies a current segment
        position = self._position
        # Fast path: the current segment alone serves the take (nearly every request).
        end = position + count - 1
        if end <= current.last:
            self._position = end + 1
            self._available -= count
            return IdBatch(((position, end),))
        ranges: list[Range] = []
        left = count
        while left:
            if position > current.last:
                current = self._queue.popleft()
                position = current.first
            end = min(current.last, position + left - 1)
            ranges.append((position, end))
            left -= end - position + 1
            position = end + 1
        self._switch(current)
        self._position = position
        self._available -= count
        return IdBatch(tuple(ranges))

    def take_within(self, count: int) -> Range | None:
        """:meth:`take` of ``count`` IDs as one range when the current segment alone holds them, else ``None``.

        ``None`` consumes nothing (call :meth:`take`): the hot path of a request, without an
        :class:`IdBatch` built for a single range.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        current = self._current
        position = self._position
        end = position + count - 1
        if current is None or end > current.last:
            return None
        self._position = end + 1
        self._available -= count
        return (position, end)

    def take_run(self, limit: int) -> Range | NeedSegment:
        """Hand out up to ``limit`` IDs as one range of a single segment, or :data:`NEED_SEGMENT` if none is buffered.

        The run ends early where the current segment ends (the next call starts the next segment), so a
        caller can keep it as a cursor of two integers. IDs come in the same order as from :meth:`take`,
        and the two may be mixed.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if not self._available:
            return NEED_SEGMENT
        current = self._current
        assert current is not None  # _available > 0 implies a current segment
        position = self._position
        if position > current.last:  # used up: a queued segment exists, since IDs are available
            current = self._queue.popleft()
            self._switch(current)
            position = current.first
        end = min(current.last, position + limit - 1)
        self._position = end + 1
        self._available -= end - position + 1
        return (position, end)

    def admissible(self, segment: Segment) -> Segment | None:
        """The part of ``segment`` that :meth:`install` would accept: the IDs above every installed one.

        ``None`` when all of it lies at or below them. The rest must be skipped, never handed out: a buffer
        hands out increasing IDs only.
        """
        if segment.first > self._high:
            return segment
        if segment.last <= self._high:
            return None
        return Segment(self._high + 1, segment.last)

    def begin_fetch(self) -> None:
        """Record that a fetch is now in flight."""
        if self._fetching:
            raise RuntimeError("a fetch is already in flight for this tag")
        self._fetching = True

    def install(self, segment: Segment, now: float) -> None:
        """Add a fetched segment after those buffered; ends the in-flight fetch.

        Raises:
            ValueError: the segment overlaps or lies below one installed before. The store grants
                increasing segments, so this means two writers share a tag's row wrongly, and
                handing the IDs out could repeat them.
        """
        if segment.first <= self._high:
            self._fetching = False
            raise ValueError(
                f"segment [{segment.first}, {segment.last}] is not above the last one installed "
                f"(ending at {self._high}); refusing IDs that may repeat"
            )
        self._fetching = False
        self._fetches += 1
        self._last_install_at = now
        self._high = segment.last
        self._available += segment.size
        if self._current is None or (self._position > self._current.last and not self._queue):
            # The current segment is used up (or never existed) and none waits: switch at once.
            self._switch(segment)
            self._position = segment.first
        else:
            self._queue.append(segment)

    def _switch(self, segment: Segment) -> None:
        """Make ``segment`` the current one (the caller sets the position)."""
        self._current = segment
        # used > threshold * size  <=>  used > floor(threshold * size), as used is an integer; and
        # position > last (used up) always wants one: hence the cap at size - 1.
        size = segment.last - segment.first + 1
        self._fetch_at = segment.first + min(math.floor(self.prefetch_threshold * size), size - 1)

    def fetch_failed(self) -> None:
        """Record that the in-flight fetch failed; the shell retries it with backoff."""
        self._fetching = False
        self._failed_fetches += 1
