"""The segment allocator against the in-memory store: waiting, single fetch, retries, tags."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from dispenser.core.errors import ResidueOverlap, StoreUnavailable, TagExhausted, UnknownTag
from dispenser.core.residue import Residue
from dispenser.core.segment import Segment
from dispenser.ports import Allocation
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import MemorySegmentStore

T = TypeVar("T")
FAST = AllocatorSettings(retry_initial=0.01, retry_max=0.02, unknown_tag_refresh_interval=0.0)


class GatedStore(MemorySegmentStore):
    """The memory store, with fetches held until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        await self.gate.wait()
        return await super().next_segment(tag, step, above=above)


@pytest.fixture
def clock() -> ManualClock:
    """Virtual time: deadlines and retry backoffs pass only when the test advances it."""
    return ManualClock()


def deadline(clock: ManualClock, seconds: float = 1.0) -> float:
    return clock.monotonic() + seconds


async def finish(clock: ManualClock, awaitable: Awaitable[T], limit: float = 30.0) -> T:
    """Await ``awaitable`` while advancing ``clock`` (in 10 ms steps) until it is done."""
    task = asyncio.ensure_future(awaitable)
    await clock.run_until(task.done, limit=limit)
    return await task


async def allocator_with(
    clock: ManualClock, store: MemorySegmentStore, *tags: tuple[str, int], settings: AllocatorSettings = FAST
) -> SegmentAllocator:
    for tag, step in tags:
        await store.add_tag(tag, step)
    allocator = SegmentAllocator(store, clock, settings)
    await allocator.refresh()
    return allocator


async def test_waiters_share_one_fetch_and_get_distinct_ids(clock: ManualClock) -> None:
    """Fifty requests on an empty buffer wait on a single fetch, then each gets its own IDs."""
    store = GatedStore()
    allocator = await allocator_with(clock, store, ("t", 1000))
    takes = [asyncio.ensure_future(allocator.take("t", 3, deadline(clock))) for _ in range(50)]
    await settle()
    assert not any(t.done() for t in takes)
    store.gate.set()
    batches = await asyncio.gather(*takes)
    ids = [i for b in batches for first, last in b.ranges for i in range(first, last + 1)]
    assert sorted(ids) == list(range(1, 151))
    assert store.calls <= 2  # the first segment, maybe the prefetch of the next: never one per waiter


async def test_prefetch_makes_the_switch_over_wait_free(clock: ManualClock) -> None:
    """Past 10% of a segment the next is fetched in the background; crossing over needs no wait."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("t", 100))
    await finish(clock, allocator.take("t", 11, deadline(clock)))
    await settle()  # the background prefetch runs
    assert allocator.get("t").stats().next  # type: ignore[union-attr]
    assert store.calls == 2
    batch = allocator.try_take("t", 100)  # crosses from the first segment into the second
    assert batch is not None
    assert batch.ranges == ((12, 100), (101, 111))


async def test_store_down_waiters_fail_at_deadline_then_recover(clock: ManualClock) -> None:
    """With the store down a dry tag answers StoreUnavailable at the deadline; once up, it serves again."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("t", 10))
    await finish(clock, allocator.take("t", 10, deadline(clock)))
    await settle()  # the prefetch of the second segment lands
    store.set_unavailable()
    await finish(clock, allocator.take("t", 10, deadline(clock)))  # the prefetched segment still serves
    waiting = asyncio.ensure_future(allocator.take("t", 1, deadline(clock, 0.2)))
    await clock.advance(0.199)
    assert not waiting.done()  # not a moment before its deadline
    await clock.advance(0.002)
    assert waiting.done()
    with pytest.raises(StoreUnavailable) as failure:
        await waiting
    assert failure.value.retryable
    calls_while_down = store.calls
    await clock.advance(0.1)
    assert store.calls > calls_while_down  # the fetch keeps being retried in the background
    store.set_unavailable(False)
    batch = await finish(clock, allocator.take("t", 1, deadline(clock)))
    assert batch.ranges[0][0] > 20


async def test_batch_larger_than_step_fetches_enough(clock: ManualClock) -> None:
    """A request for more IDs than a segment holds is served from a larger explicit segment."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("t", 10))
    batch = await finish(clock, allocator.take("t", 95, deadline(clock)))
    ids = [i for first, last in batch.ranges for i in range(first, last + 1)]
    assert ids == list(range(1, 96))
    assert store.calls <= 3


async def test_unknown_tag_and_tag_appearing_later(clock: ManualClock) -> None:
    """An unknown tag raises UnknownTag; once added to the store, the next request finds it."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store)
    with pytest.raises(UnknownTag):
        await finish(clock, allocator.take("late", 1, deadline(clock)))
    await store.add_tag("late", 5, start=70)
    assert (await finish(clock, allocator.take("late", 1, deadline(clock)))).ranges == ((70, 70),)


async def test_a_tag_added_just_after_a_miss_is_served_not_unknown(clock: ManualClock) -> None:
    """Lookups are rate-limited, but a request that finds the last one too recent waits for the next.

    The tag appears a moment after another request's miss: the next requests get IDs. A request whose
    deadline ends before the next lookup is told the tag is unknown.
    """
    store = MemorySegmentStore()
    allocator = SegmentAllocator(store, clock, AllocatorSettings(unknown_tag_refresh_interval=0.3))
    with pytest.raises(UnknownTag):
        await finish(clock, allocator.take("late", 1, deadline(clock)))
    await store.add_tag("late", 5, start=70)
    with pytest.raises(UnknownTag):
        await allocator.take("late", 1, deadline(clock, 0.05))  # at once: the next lookup is too far
    results = await finish(
        clock, asyncio.gather(*(allocator.take("late", 1, deadline(clock)) for _ in range(5)))
    )
    assert sorted(r.ranges[0][0] for r in results) == [70, 71, 72, 73, 74]


async def test_a_tag_at_the_end_of_the_id_space_fails_for_good_not_for_now(clock: ManualClock) -> None:
    """Buffered IDs are still handed out; then takes fail with tag_exhausted (not retryable), not unavailable."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("end", 10))
    await store.set_step("end", 10)
    last_start = 2**63 - 1 - 15
    store._rows["end"].max_id = last_start  # the tag's next segment is the last one that fits
    taken = [(await finish(clock, allocator.take("end", 1, deadline(clock)))).ranges[0][0] for _ in range(10)]
    assert taken == list(range(last_start, last_start + 10))
    with pytest.raises(TagExhausted) as caught:
        await finish(clock, allocator.take("end", 1, deadline(clock)))
    assert (caught.value.code, caught.value.retryable) == ("tag_exhausted", False)


async def test_tag_removed_from_store_becomes_unknown(clock: ManualClock) -> None:
    """A tag removed from the store is dropped at the next refresh, and its requests fail as unknown."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("t", 5))
    await store.remove_tag("t")
    await allocator.refresh()
    assert allocator.get("t") is None
    with pytest.raises(UnknownTag):
        await finish(clock, allocator.take("t", 1, deadline(clock)))


async def test_tag_removed_while_fetching_fails_waiters_as_unknown(clock: ManualClock) -> None:
    """If the store says the tag is gone during a fetch, the waiters get UnknownTag at once."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("t", 5))
    await store.remove_tag("t")
    with pytest.raises(UnknownTag):
        await finish(clock, allocator.take("t", 1, deadline(clock)))
    assert allocator.get("t") is None


class OverlappingStore(MemorySegmentStore):
    """A broken store that grants the same segment twice."""

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        allocation = await super().next_segment(tag, step, above=above)
        return Allocation(Segment(1, allocation.segment.size), allocation.configured_step)


class FlakyStore(MemorySegmentStore):
    """A store whose first fetch fails with a bug (not an outage)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        if self.broken:
            self.broken = False
            raise KeyError("a bug in the store")
        return await super().next_segment(tag, step, above=above)


async def test_overlapping_segment_stops_the_tag_instead_of_repeating_ids(clock: ManualClock) -> None:
    """A store that grants an overlapping segment is refused: requests fail, no ID is handed out twice."""
    store = OverlappingStore()
    allocator = await allocator_with(clock, store, ("t", 10))
    batch = await finish(clock, allocator.take("t", 10, deadline(clock)))
    assert batch.ranges == ((1, 10),)
    with pytest.raises(StoreUnavailable, match="overlapping"):
        await finish(clock, allocator.take("t", 1, deadline(clock, 0.3)))


async def test_unexpected_fetch_failure_is_retried(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch that fails with a bug is logged with its traceback and retried; the request succeeds."""
    store = FlakyStore()
    allocator = await allocator_with(clock, store, ("t", 10))
    assert (await finish(clock, allocator.take("t", 1, deadline(clock)))).ranges == ((1, 1),)
    assert "failed unexpectedly" in caplog.text


async def test_fetches_per_minute_counts_the_last_minute(clock: ManualClock) -> None:
    """Fetches per minute: since start while younger than a minute, then over the last minute only."""
    store = MemorySegmentStore()
    start = clock.monotonic()
    allocator = await allocator_with(clock, store, ("t", 10))
    tag = allocator.tags["t"]
    assert tag.fetches_per_minute() == 0.0
    for _ in range(6):  # each take of a whole segment sets off one fetch, and the next take waits on it
        await finish(clock, allocator.take("t", 10, deadline(clock)))
        await settle()
        await clock.advance(5.0)
    # 30 s old, and the 6 takes fetched 6 or 7 segments (the last one is in the background)
    assert tag.fetches_per_minute() == pytest.approx(tag.fetches * 60 / (clock.monotonic() - start), rel=0.01)
    assert tag.fetches >= 6
    await clock.advance(61.0)
    assert tag.fetches_per_minute() == 0.0  # nothing fetched in the last minute
    await finish(clock, allocator.take("t", 10, deadline(clock)))
    await settle()
    assert 1.0 <= tag.fetches_per_minute() <= 2.0


async def test_a_strided_tag_hands_out_its_class_as_one_id_ranges(clock: ManualClock) -> None:
    """Stride 3, offset 2: the IDs 2, 5, 8, … across segments, each as a range of one ID."""
    store = MemorySegmentStore()
    await store.add_tag("t", 4, residue=Residue(3, 2))
    allocator = SegmentAllocator(store, clock, FAST)
    await allocator.refresh()
    batch = await finish(clock, allocator.take("t", 6, deadline(clock)))
    assert batch.ranges == ((2, 2), (5, 5), (8, 8), (11, 11), (14, 14), (17, 17))
    assert batch.count == 6


class ClassChangingStore(MemorySegmentStore):
    """The memory store, whose tag 't' changes class after its first segment (what must never happen)."""

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        allocation = await super().next_segment(tag, step, above=above)
        if self.calls > 1:
            return Allocation(allocation.segment, allocation.configured_step, Residue(2, 1))
        return allocation


async def test_a_class_changed_under_the_worker_stops_the_tag(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Ordinals of two classes must not mix in one buffer: the tag answers `unavailable` instead."""
    store = ClassChangingStore()
    allocator = await allocator_with(clock, store, ("t", 10))
    first = await finish(clock, allocator.take("t", 10, deadline(clock)))
    assert first.ranges == ((1, 10),)
    await settle()  # the prefetch, of another class, is refused
    with pytest.raises(StoreUnavailable, match="stride of 't' changed"):
        await finish(clock, allocator.take("t", 1, deadline(clock)))
    assert "never change a tag's class" in caplog.text


class RecordingCheck:
    """A residue check that refuses the classes it is told to, and records what was claimed and released."""

    def __init__(self, refuse: set[Residue]) -> None:
        self.refuse = refuse
        self.claimed: list[tuple[str, Residue]] = []
        self.released: list[str] = []

    async def claim(self, tag: str, residue: Residue) -> None:
        self.claimed.append((tag, residue))
        if residue in self.refuse:
            raise ResidueOverlap(tag, f"{residue.offset} mod {residue.stride} here", "another database's")

    def release(self, tag: str) -> None:
        self.released.append(tag)


async def test_a_tag_whose_class_is_refused_hands_out_no_id(clock: ManualClock) -> None:
    """The check runs on the first segment, before any ID: a refusal is the reply, every time, no IDs."""
    store = MemorySegmentStore()
    await store.add_tag("t", 10, residue=Residue(2, 0))
    await store.add_tag("u", 10)
    allocator = SegmentAllocator(store, clock, FAST)
    await allocator.refresh()
    check = RecordingCheck({Residue(2, 0)})
    allocator.check_residues(check)  # tags known before the check was wired are checked too
    for _ in range(2):
        with pytest.raises(ResidueOverlap) as caught:
            await finish(clock, allocator.take("t", 1, deadline(clock)))
        assert caught.value.code == "residue_overlap"
    assert allocator.try_take("t", 1) is None
    assert (await finish(clock, allocator.take("u", 3, deadline(clock)))).ranges == ((1, 3),)
    await finish(clock, allocator.take("u", 10, deadline(clock)))  # a second segment: claimed once only
    assert check.claimed == [("t", Residue(2, 0)), ("u", Residue())]


async def test_a_later_refusal_stops_the_buffered_ids_too(clock: ManualClock) -> None:
    """A rival heard while serving: the tag's buffered IDs are not handed out any more; a removed tag is released."""
    store = MemorySegmentStore()
    allocator = await allocator_with(clock, store, ("t", 100))
    check = RecordingCheck(set())
    allocator.check_residues(check)
    assert (await finish(clock, allocator.take("t", 1, deadline(clock)))).ranges == ((1, 1),)
    allocator.refuse("t", ResidueOverlap("t", "0 mod 1 here", "0 mod 1 there"))
    assert allocator.try_take("t", 1) is None
    with pytest.raises(ResidueOverlap):
        await finish(clock, allocator.take("t", 1, deadline(clock)))
    await store.remove_tag("t")
    await allocator.refresh()
    assert check.released == ["t"]


async def test_a_fetch_in_flight_at_a_refusal_is_dropped(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused while its fetch waits on the store: the segment is neither installed nor taken for a recovery."""
    store = GatedStore()
    allocator = await allocator_with(clock, store, ("t", 10))
    allocator.check_residues(RecordingCheck(set()))
    waiting = asyncio.ensure_future(allocator.take("t", 1, deadline(clock, 5.0)))
    await settle()
    allocator.refuse("t", ResidueOverlap("t", "0 mod 1 here", "0 mod 1 there"))
    store.gate.set()
    with pytest.raises(ResidueOverlap):
        await finish(clock, waiting)
    await settle()
    tag = allocator.get("t")
    assert tag is not None
    assert tag.stats().current is None
    assert "recovered" not in caplog.text
