"""The double buffer: unit tests and properties (no ID twice, increasing, inside fetched segments)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dispenser.core.ids import IdBatch
from dispenser.core.segment import NEED_SEGMENT, Segment, SegmentBuffer


def ids_of(batch: IdBatch) -> list[int]:
    """The batch's IDs one by one."""
    return [i for first, last in batch.ranges for i in range(first, last + 1)]


def test_segment_from_max_id_matches_leaf() -> None:
    """Leaf's UPDATE returning max_id=1001 after a step of 1000 grants [1, 1000]."""
    assert Segment.from_max_id(1001, 1000) == Segment(1, 1000)


def test_empty_buffer_needs_a_segment_and_wants_a_fetch() -> None:
    """A new buffer serves nothing and asks for its first segment."""
    buf = SegmentBuffer()
    assert buf.take(1) is NEED_SEGMENT
    assert buf.wants_fetch


def test_take_within_segment_returns_one_range() -> None:
    """A take that fits in the current segment is one range, and the position moves on."""
    buf = SegmentBuffer()
    buf.install(Segment(1, 100), now=0.0)
    assert buf.take(5) == IdBatch(((1, 5),))
    assert buf.take(1) == IdBatch(((6, 6),))
    assert buf.remaining == 94


def test_prefetch_wanted_only_past_threshold() -> None:
    """With a 10% threshold the next segment is wanted once more than 10 of 100 IDs are used."""
    buf = SegmentBuffer(prefetch_threshold=0.1)
    buf.install(Segment(1, 100), now=0.0)
    buf.take(10)
    assert not buf.wants_fetch
    buf.take(1)
    assert buf.wants_fetch


def test_one_fetch_in_flight_at_most() -> None:
    """While a fetch is in flight the buffer wants no other, and a second begin is refused."""
    buf = SegmentBuffer()
    buf.begin_fetch()
    assert not buf.wants_fetch
    with pytest.raises(RuntimeError):
        buf.begin_fetch()


def test_take_across_boundary_returns_ranges() -> None:
    """A take larger than what is left spans into the next segment as a list of ranges."""
    buf = SegmentBuffer()
    buf.install(Segment(1, 10), now=0.0)
    buf.take(8)
    buf.begin_fetch()
    buf.install(Segment(101, 110), now=1.0)
    assert buf.take(5) == IdBatch(((9, 10), (101, 103)))
    assert buf.stats().current is not None
    assert buf.stats().current.first == 101  # type: ignore[union-attr]


def test_short_buffer_consumes_nothing() -> None:
    """A take larger than everything buffered returns NEED_SEGMENT and leaves the buffer as it was."""
    buf = SegmentBuffer()
    buf.install(Segment(1, 10), now=0.0)
    assert buf.take(11) is NEED_SEGMENT
    assert buf.take(10) == IdBatch(((1, 10),))


def test_install_below_previous_is_refused() -> None:
    """A segment overlapping one installed before is refused rather than risk repeating IDs."""
    buf = SegmentBuffer()
    buf.install(Segment(1, 10), now=0.0)
    buf.begin_fetch()
    with pytest.raises(ValueError, match="not above"):
        buf.install(Segment(5, 20), now=1.0)
    assert not buf.fetching


def test_install_after_exhaustion_switches_at_once() -> None:
    """When the current segment is used up, a newly installed one becomes current."""
    buf = SegmentBuffer()
    buf.install(Segment(1, 2), now=0.0)
    buf.take(2)
    assert buf.wants_fetch
    buf.begin_fetch()
    buf.install(Segment(11, 20), now=1.0)
    assert buf.take(1) == IdBatch(((11, 11),))


def test_stats_report_bounds_position_and_fetch_state() -> None:
    """Stats show both segments' bounds, the position, and the fetch counters."""
    buf = SegmentBuffer()
    buf.install(Segment(1, 100), now=5.0)
    buf.take(50)
    buf.begin_fetch()
    buf.install(Segment(101, 200), now=6.0)
    stats = buf.stats()
    assert stats.current is not None
    assert (stats.current.first, stats.current.last, stats.current.position) == (1, 100, 51)
    assert [(s.first, s.last) for s in stats.next] == [(101, 200)]
    assert (stats.remaining, stats.fetches, stats.fetching, stats.last_install_at) == (150, 2, False, 6.0)


def test_threshold_out_of_range_refused() -> None:
    """A prefetch threshold outside [0, 1] is a configuration error."""
    with pytest.raises(ValueError, match="prefetch_threshold"):
        SegmentBuffer(prefetch_threshold=1.5)


@given(
    steps=st.lists(st.integers(1, 50), min_size=1, max_size=20),
    counts=st.lists(st.integers(1, 120), min_size=1, max_size=60),
)
def test_takes_hand_out_each_id_once_in_order(steps: list[int], counts: list[int]) -> None:
    """Whatever the segment sizes and takes, IDs are unique, strictly increasing and all handed out."""
    buf = SegmentBuffer()
    next_first = 1
    for step in steps:
        buf.install(Segment(next_first, next_first + step - 1), now=0.0)
        next_first += step + 7  # gaps between segments, as when another worker took one
    issued: list[int] = []
    for count in counts:
        batch = buf.take(count)
        if batch is NEED_SEGMENT:
            assert count > buf.remaining
            continue
        assert batch.count == count
        issued.extend(ids_of(batch))
    assert issued == sorted(set(issued))
    assert len(issued) + buf.remaining == sum(steps)


@given(step=st.integers(10, 1000), counts=st.lists(st.integers(1, 1000), min_size=1, max_size=200))
def test_fetching_at_the_switch_keeps_a_whole_segment_in_hand(step: int, counts: list[int]) -> None:
    """Default buffer, fetches that complete at once: after every take, at least one whole segment is in hand.

    The runway promise rests on this: segments of S seconds of demand, and never less than one of them
    buffered, so with the database gone at any moment the worker goes on for S seconds (less only the
    round trip of a fetch in flight). Leaf's 10% threshold holds only 0.9 of a segment just before it.
    """
    buf = SegmentBuffer()
    max_id = 0

    def fetch_what_is_wanted() -> None:
        nonlocal max_id
        while buf.wants_fetch:
            buf.begin_fetch()
            max_id += step
            buf.install(Segment.from_max_id(max_id, step), now=0.0)

    fetch_what_is_wanted()
    for count in counts:
        batch = buf.take(min(count, step))
        assert batch is not NEED_SEGMENT
        fetch_what_is_wanted()
        assert buf.remaining >= step, (buf.remaining, step)


def test_leafs_threshold_leaves_less_than_a_segment_before_its_prefetch() -> None:
    """The case the default avoids: at 10%, just before the prefetch, only 0.9 of a segment is in hand."""
    buf = SegmentBuffer(prefetch_threshold=0.1)
    buf.install(Segment(0, 999), now=0.0)
    buf.take(100)
    assert not buf.wants_fetch
    assert buf.remaining == 900


def test_take_run_stays_within_one_segment() -> None:
    """A run ends where its segment ends; the next run starts the next segment."""
    buf = SegmentBuffer()
    assert buf.take_run(5) is NEED_SEGMENT
    buf.begin_fetch()
    buf.install(Segment(1, 10), now=0.0)
    assert buf.take_run(4) == (1, 4)
    assert buf.wants_fetch  # fetch at the switch: a run counts as use
    buf.begin_fetch()
    buf.install(Segment(21, 30), now=1.0)
    assert buf.take_run(100) == (5, 10)
    assert buf.take_run(3) == (21, 23)
    assert buf.remaining == 7
    with pytest.raises(ValueError, match="limit"):
        buf.take_run(0)


def test_admissible_keeps_only_ids_above_everything_installed() -> None:
    """A range from a source that is behind is clipped to the IDs above the last installed, or refused."""
    buf = SegmentBuffer()
    assert buf.high == -1
    assert buf.admissible(Segment(0, 9)) == Segment(0, 9)
    buf.begin_fetch()
    buf.install(Segment(100, 199), now=0.0)
    assert buf.high == 199
    assert buf.admissible(Segment(50, 150)) is None
    assert buf.admissible(Segment(150, 250)) == Segment(200, 250)
    assert buf.admissible(Segment(300, 400)) == Segment(300, 400)


@given(
    ranges=st.lists(st.tuples(st.integers(0, 500), st.integers(0, 60)), min_size=1, max_size=30),
    limits=st.lists(st.integers(1, 40), min_size=1, max_size=60),
)
def test_admitted_ranges_from_unordered_sources_hand_out_increasing_ids(
    ranges: list[tuple[int, int]], limits: list[int]
) -> None:
    """Ranges in any order, admitted then installed: runs hand out strictly increasing IDs, each granted."""
    buf = SegmentBuffer()
    granted: set[int] = set()
    issued: list[int] = []
    for (first, length), limit in zip(ranges, limits * len(ranges), strict=False):
        part = buf.admissible(Segment(first, first + length))
        if part is not None:
            buf.install(part, now=0.0)
            granted.update(range(first, first + length + 1))
        run = buf.take_run(limit)
        if run is not NEED_SEGMENT:
            issued.extend(range(run[0], run[1] + 1))
    assert all(a < b for a, b in itertools.pairwise(issued))
    assert set(issued) <= granted


class DoubleBufferMachine(RuleBasedStateMachine):
    """Any interleaving of takes, fetch starts, installs and failures keeps the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = SegmentBuffer(prefetch_threshold=0.1)
        self.store_max = 1  # Leaf's max_id: the next segment starts here
        self.granted: list[Segment] = []
        self.issued: list[int] = []

    @rule(count=st.integers(1, 300))
    def take(self, count: int) -> None:
        """Take IDs; the result is a batch of exactly count IDs or nothing at all."""
        before = self.buf.remaining
        batch = self.buf.take(count)
        if batch is NEED_SEGMENT:
            assert count > before
            assert self.buf.remaining == before
            return
        assert batch.count == count
        ids = ids_of(batch)
        if self.issued:
            assert ids[0] > self.issued[-1]
        self.issued.extend(ids)

    @initialize(threshold=st.sampled_from([0.0, 0.1, 0.5, 0.999, 1.0]) | st.floats(0.0, 1.0))
    def threshold(self, threshold: float) -> None:
        """Any prefetch threshold: wants_fetch's precomputed position must agree with its rule for each."""
        self.buf = SegmentBuffer(prefetch_threshold=threshold)

    @rule(count=st.integers(1, 300))
    def take_within(self, count: int) -> None:
        """The hot path's take: count IDs as one range of the current segment, or nothing at all."""
        before = self.buf.remaining
        current = self.buf.stats().current
        run = self.buf.take_within(count)
        if run is None:
            assert current is None or current.remaining < count
            assert self.buf.remaining == before
            return
        first, last = run
        assert current is not None
        assert first == current.position
        assert last - first + 1 == count
        assert last <= current.last  # within the current segment
        assert self.buf.remaining == before - count
        if self.issued:
            assert first > self.issued[-1]
        self.issued.extend(range(first, last + 1))

    @rule(limit=st.integers(1, 300))
    def take_run(self, limit: int) -> None:
        """Take a run for a cursor: one range of at most ``limit`` IDs, or nothing if none are buffered."""
        before = self.buf.remaining
        run = self.buf.take_run(limit)
        if run is NEED_SEGMENT:
            assert before == 0
            return
        first, last = run
        assert 1 <= last - first + 1 <= limit
        assert any(s.first <= first and last <= s.last for s in self.granted)  # within one segment
        assert self.buf.remaining == before - (last - first + 1)
        if self.issued:
            assert first > self.issued[-1]
        self.issued.extend(range(first, last + 1))

    @precondition(lambda self: not self.buf.fetching)
    @rule()
    def begin_fetch(self) -> None:
        """Start a fetch (the shell does when wants_fetch, or when a request waits)."""
        self.buf.begin_fetch()

    @precondition(lambda self: self.buf.fetching)
    @rule(step=st.integers(1, 200), skipped=st.integers(0, 50))
    def install(self, step: int, skipped: int) -> None:
        """The store grants the next segment (others may have taken some in between)."""
        self.store_max += skipped
        segment = Segment.from_max_id(self.store_max + step, step)
        self.store_max += step
        self.granted.append(segment)
        self.buf.install(segment, now=0.0)

    @precondition(lambda self: self.buf.fetching)
    @rule()
    def fail(self) -> None:
        """The fetch fails; nothing changes but the counter."""
        self.buf.fetch_failed()

    @invariant()
    def no_id_twice_and_all_inside_segments(self) -> None:
        """Every issued ID is unique, increasing, and inside a granted segment."""
        assert all(a < b for a, b in zip(self.issued, self.issued[1:], strict=False))
        granted = sum(s.size for s in self.granted)
        assert len(self.issued) + self.buf.remaining == granted
        for i in self.issued[-300:]:
            assert any(s.first <= i <= s.last for s in self.granted)

    @invariant()
    def wants_fetch_only_when_idle_and_nothing_queued(self) -> None:
        """The buffer never asks for a second fetch while one is in flight or a segment waits."""
        stats = self.buf.stats()
        if self.buf.wants_fetch:
            assert not stats.fetching
            assert not stats.next

    @invariant()
    def wants_fetch_follows_its_rule(self) -> None:
        """Idle, nothing queued, and no current segment, or more than the threshold of it used, or all of it."""
        stats = self.buf.stats()
        current = stats.current
        if stats.fetching or stats.next:
            expected = False
        elif current is None:
            expected = True
        else:
            used = current.position - current.first
            size = current.last - current.first + 1
            expected = used > stats.prefetch_threshold * size or current.position > current.last
        assert self.buf.wants_fetch == expected


TestDoubleBuffer = DoubleBufferMachine.TestCase
