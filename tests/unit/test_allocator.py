"""The segment allocator against the in-memory store: waiting, single fetch, retries, tags."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.adapters.memory import MemorySegmentStore
from dispenser.core.errors import StoreUnavailable, TagExhausted, UnknownTag
from dispenser.core.segment import Segment
from dispenser.ports import Allocation, SystemClock
from dispenser.service.dedup import ReplayCache
from dispenser.service.segments import AllocatorSettings, SegmentAllocator

CLOCK = SystemClock()
FAST = AllocatorSettings(retry_initial=0.01, retry_max=0.02, unknown_tag_refresh_interval=0.0)


class GatedStore(MemorySegmentStore):
    """The memory store, with fetches held until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def next_segment(self, tag: str, step: int | None = None) -> Allocation:
        await self.gate.wait()
        return await super().next_segment(tag, step)


def deadline(seconds: float = 1.0) -> float:
    return CLOCK.monotonic() + seconds


async def allocator_with(store: MemorySegmentStore, *tags: tuple[str, int]) -> SegmentAllocator:
    for tag, step in tags:
        await store.add_tag(tag, step)
    allocator = SegmentAllocator(store, CLOCK, FAST)
    await allocator.refresh()
    return allocator


async def test_waiters_share_one_fetch_and_get_distinct_ids() -> None:
    """Fifty requests on an empty buffer wait on a single fetch, then each gets its own IDs."""
    store = GatedStore()
    allocator = await allocator_with(store, ("t", 1000))
    takes = [asyncio.ensure_future(allocator.take("t", 3, deadline())) for _ in range(50)]
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in takes)
    store.gate.set()
    batches = await asyncio.gather(*takes)
    ids = [i for b in batches for first, last in b.ranges for i in range(first, last + 1)]
    assert sorted(ids) == list(range(1, 151))
    assert store.calls <= 2  # the first segment, maybe the prefetch of the next: never one per waiter


async def test_prefetch_makes_the_switch_over_wait_free() -> None:
    """Past 10% of a segment the next is fetched in the background; crossing over needs no wait."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store, ("t", 100))
    await allocator.take("t", 11, deadline())
    for _ in range(100):  # let the background prefetch run
        if allocator.get("t").stats().next:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0)
    assert store.calls == 2
    batch = allocator.try_take("t", 100)  # crosses from the first segment into the second
    assert batch is not None
    assert batch.ranges == ((12, 100), (101, 111))


async def test_store_down_waiters_fail_at_deadline_then_recover() -> None:
    """With the store down a dry tag answers StoreUnavailable at the deadline; once up, it serves again."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store, ("t", 10))
    await allocator.take("t", 10, deadline())
    await asyncio.sleep(0.01)
    store.set_unavailable()
    await allocator.take("t", 10, deadline())  # the prefetched segment still serves
    started = CLOCK.monotonic()
    with pytest.raises(StoreUnavailable) as failure:
        await allocator.take("t", 1, deadline(0.2))
    assert failure.value.retryable
    assert 0.15 < CLOCK.monotonic() - started < 1.0
    calls_while_down = store.calls
    await asyncio.sleep(0.1)
    assert store.calls > calls_while_down  # the fetch keeps being retried in the background
    store.set_unavailable(False)
    batch = await allocator.take("t", 1, deadline())
    assert batch.ranges[0][0] > 20


async def test_batch_larger_than_step_fetches_enough() -> None:
    """A request for more IDs than a segment holds is served from a larger explicit segment."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store, ("t", 10))
    batch = await allocator.take("t", 95, deadline())
    ids = [i for first, last in batch.ranges for i in range(first, last + 1)]
    assert ids == list(range(1, 96))
    assert store.calls <= 3


async def test_unknown_tag_and_tag_appearing_later() -> None:
    """An unknown tag raises UnknownTag; once added to the store, the next request finds it."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store)
    with pytest.raises(UnknownTag):
        await allocator.take("late", 1, deadline())
    await store.add_tag("late", 5, start=70)
    assert (await allocator.take("late", 1, deadline())).ranges == ((70, 70),)


async def test_a_tag_added_just_after_a_miss_is_served_not_unknown() -> None:
    """Lookups are rate-limited, but a request that finds the last one too recent waits for the next.

    The tag appears a moment after another request's miss: the next requests get IDs. A request whose deadline ends before the next lookup is told
    the tag is unknown.
    """
    store = MemorySegmentStore()
    allocator = SegmentAllocator(store, CLOCK, AllocatorSettings(unknown_tag_refresh_interval=0.3))
    with pytest.raises(UnknownTag):
        await allocator.take("late", 1, deadline())
    await store.add_tag("late", 5, start=70)
    with pytest.raises(UnknownTag):
        await allocator.take("late", 1, deadline(0.05))
    results = await asyncio.gather(*(allocator.take("late", 1, deadline()) for _ in range(5)))
    assert sorted(r.ranges[0][0] for r in results) == [70, 71, 72, 73, 74]


async def test_a_tag_at_the_end_of_the_id_space_fails_for_good_not_for_now() -> None:
    """Buffered IDs are still handed out; then takes fail with tag_exhausted (not retryable), not unavailable."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store, ("end", 10))
    await store.set_step("end", 10)
    last_start = 2**63 - 1 - 15
    store._rows["end"].max_id = last_start  # the tag's next segment is the last one that fits
    taken = [(await allocator.take("end", 1, deadline())).ranges[0][0] for _ in range(10)]
    assert taken == list(range(last_start, last_start + 10))
    with pytest.raises(TagExhausted) as caught:
        await allocator.take("end", 1, deadline())
    assert (caught.value.code, caught.value.retryable) == ("tag_exhausted", False)


async def test_tag_removed_from_store_becomes_unknown() -> None:
    """A tag removed from the store is dropped at the next refresh, and its requests fail as unknown."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store, ("t", 5))
    await store.remove_tag("t")
    await allocator.refresh()
    assert allocator.get("t") is None
    with pytest.raises(UnknownTag):
        await allocator.take("t", 1, deadline())


async def test_tag_removed_while_fetching_fails_waiters_as_unknown() -> None:
    """If the store says the tag is gone during a fetch, the waiters get UnknownTag at once."""
    store = MemorySegmentStore()
    allocator = await allocator_with(store, ("t", 5))
    await store.remove_tag("t")
    with pytest.raises(UnknownTag):
        await allocator.take("t", 1, deadline())
    assert allocator.get("t") is None


class Ticker:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_replay_cache_returns_the_same_result_within_ttl() -> None:
    """A key seen within the TTL returns the stored result; after the TTL it is computed afresh."""
    clock = Ticker()
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=clock)
    results = iter(range(100))

    async def compute() -> int:
        return next(results)

    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 0
    clock.now = 59.0
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 0
    clock.now = 61.0
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), compute) == 1


async def test_replay_cache_shares_a_computation_in_flight() -> None:
    """Two requests with one key at the same time share one computation."""
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=Ticker())
    gate = asyncio.Event()
    calls = 0

    async def compute() -> int:
        nonlocal calls
        calls += 1
        await gate.wait()
        return 7

    first = asyncio.ensure_future(cache.get_or_compute(("t", "a"), (1, "ids"), compute))
    second = asyncio.ensure_future(cache.get_or_compute(("t", "a"), (1, "ids"), compute))
    await asyncio.sleep(0)
    gate.set()
    assert list(await asyncio.gather(first, second)) == [7, 7]
    assert calls == 1


async def test_replay_cache_forgets_failures() -> None:
    """A failed computation is not remembered: the retry computes again."""
    cache: ReplayCache[int] = ReplayCache(ttl=60.0, clock=Ticker())

    async def fail() -> int:
        raise StoreUnavailable("down")

    async def succeed() -> int:
        return 3

    with pytest.raises(StoreUnavailable):
        await cache.get_or_compute(("t", "a"), (1, "ids"), fail)
    assert await cache.get_or_compute(("t", "a"), (1, "ids"), succeed) == 3


class OverlappingStore(MemorySegmentStore):
    """A broken store that grants the same segment twice."""

    async def next_segment(self, tag: str, step: int | None = None) -> Allocation:
        allocation = await super().next_segment(tag, step)
        return Allocation(Segment(1, allocation.segment.size), allocation.configured_step)


class FlakyStore(MemorySegmentStore):
    """A store whose first fetch fails with a bug (not an outage)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    async def next_segment(self, tag: str, step: int | None = None) -> Allocation:
        if self.broken:
            self.broken = False
            raise KeyError("a bug in the store")
        return await super().next_segment(tag, step)


async def test_overlapping_segment_stops_the_tag_instead_of_repeating_ids() -> None:
    """A store that grants an overlapping segment is refused: requests fail, no ID is handed out twice."""
    store = OverlappingStore()
    allocator = await allocator_with(store, ("t", 10))
    batch = await allocator.take("t", 10, deadline())
    assert batch.ranges == ((1, 10),)
    with pytest.raises(StoreUnavailable, match="overlapping"):
        await allocator.take("t", 1, deadline(0.3))


async def test_unexpected_fetch_failure_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    """A fetch that fails with a bug is logged with its traceback and retried; the request succeeds."""
    store = FlakyStore()
    allocator = await allocator_with(store, ("t", 10))
    assert (await allocator.take("t", 1, deadline())).ranges == ((1, 1),)
    assert "failed unexpectedly" in caplog.text
