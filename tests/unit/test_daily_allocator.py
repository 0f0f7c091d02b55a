"""Daily tags on a worker (the in-memory store, virtual time): the day's counter, midnight, the width."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispenser.core.daily import DailyPolicy, day_of, split
from dispenser.core.errors import DayExhausted, UnknownTag
from dispenser.core.ids import IdBatch
from dispenser.ports import Allocation
from dispenser.service.segments import AllocatorSettings, SegmentAllocator, TagAllocator
from dispenser.testing.clock import ManualClock
from dispenser.testing.fakes import MemorySegmentStore

T = TypeVar("T")
FAST = AllocatorSettings(retry_initial=0.01, retry_max=0.02, unknown_tag_refresh_interval=0.0)
SHANGHAI = DailyPolicy.checked(6, "Asia/Shanghai")
# 2026-11-28 00:00 in Shanghai (UTC+8), in Unix milliseconds.
MIDNIGHT_MS = int(datetime.fromisoformat("2026-11-28T00:00:00+08:00").timestamp() * 1000)


def clock_at(ms_before_midnight: int) -> ManualClock:
    """A virtual clock ``ms_before_midnight`` before 2026-11-28 00:00 in Shanghai."""
    return ManualClock(wall_ms=MIDNIGHT_MS - ms_before_midnight)


async def finish(clock: ManualClock, awaitable: Awaitable[T], limit: float = 30.0) -> T:
    """Await ``awaitable`` while advancing ``clock`` (10 ms steps) until it is done."""
    task = asyncio.ensure_future(awaitable)
    await clock.run_until(task.done, limit=limit)
    return await task


async def worker(
    store: MemorySegmentStore, clock: ManualClock, settings: AllocatorSettings = FAST
) -> SegmentAllocator:
    allocator = SegmentAllocator(store, clock, settings)
    await allocator.refresh()
    return allocator


async def daily_store(step: int = 10, policy: DailyPolicy = SHANGHAI) -> MemorySegmentStore:
    store = MemorySegmentStore()
    await store.add_tag("order", step, daily=policy)
    await store.add_tag("plain", step)
    return store


def ids(batch: IdBatch) -> list[int]:
    return [i for first, last in batch.ranges for i in range(first, last + 1)]


async def take(
    allocator: SegmentAllocator, clock: ManualClock, count: int = 1, tag: str = "order"
) -> list[int]:
    return ids(await finish(clock, allocator.take(tag, count, clock.monotonic() + 2.0)))


async def test_a_daily_tag_hands_out_the_date_then_its_counter_from_1() -> None:
    """The first IDs of 2026-11-28 in Shanghai are 20261128000001.., contiguous within a batch."""
    clock = clock_at(-1000)  # a second after midnight
    allocator = await worker(await daily_store(), clock)
    assert await take(allocator, clock, 3) == [20261128000001, 20261128000002, 20261128000003]
    batch = allocator.try_take("order", 4)
    assert batch is not None
    assert batch.ranges == ((20261128000004, 20261128000007),)
    assert str(ids(batch)[0]) == "20261128000004"  # the decimal digits are the string form
    assert "order" not in allocator.tags  # the plain tags' dict never holds a daily tag
    assert await take(allocator, clock, 1, "plain") == [1]


async def test_the_counter_starts_again_at_midnight_and_the_day_that_ended_fetches_no_more() -> None:
    """At the zone's midnight the next ID is the new date's 1; the old day's row is left alone."""
    clock = clock_at(500)
    store = await daily_store()
    allocator = await worker(store, clock)
    assert await take(allocator, clock, 2) == [20261127000001, 20261127000002]
    await clock.advance(0.5)
    assert await take(allocator, clock, 2) == [20261128000001, 20261128000002]
    day_rows = {info.tag for info in await store.list_tags()}
    assert day_rows == {"order", "plain"}  # day rows are counters, not tags
    before = store._rows["order@20261127"].max_id
    for _ in range(30):  # far past the old day's segment: only the new day's row moves
        await take(allocator, clock, 1)
    assert store._rows["order@20261127"].max_id == before


async def test_two_workers_a_second_apart_across_midnight_never_repeat_an_id() -> None:
    """One worker already in the new day, one a second behind: each ID carries its worker's date, none twice."""
    store = await daily_store(step=3)
    ahead, behind = clock_at(500), clock_at(1500)
    a, b = await worker(store, ahead), await worker(store, behind)
    seen: list[int] = []
    for _ in range(20):  # 2 s of requests, 100 ms apart, alternating
        for allocator, clock in ((a, ahead), (b, behind)):
            got = await take(allocator, clock, 2)
            day = split(got[0], 6)[0]
            expected = 20261128 if clock.wall_ms() >= MIDNIGHT_MS else 20261127
            assert day == expected, (got, clock.wall_ms() - MIDNIGHT_MS)
            seen += got
            await clock.advance(0.1)
    assert len(seen) == len(set(seen))
    days = {split(i, 6)[0] for i in seen}
    assert days == {20261127, 20261128}


class GatedStore(MemorySegmentStore):
    """The memory store, with fetches held until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        await self.gate.wait()
        return await super().next_segment(tag, step, above=above)


async def test_a_request_that_straddles_midnight_gets_the_date_it_is_answered_on() -> None:
    """Waiting for a fetch begun at 23:59:59.9 and granted after midnight: the new date wins."""
    store = GatedStore()
    await store.add_tag("order", 10, daily=SHANGHAI)
    clock = clock_at(100)
    allocator = await worker(store, clock)
    store.gate.clear()
    request = asyncio.ensure_future(allocator.take("order", 1, clock.monotonic() + 2.0))
    await clock.advance(0.2)  # midnight passes while the day that ends fetches
    assert not request.done()
    store.gate.set()
    got = ids(await finish(clock, request))
    assert got == [20261128000001]


async def test_a_day_whose_counter_runs_out_of_digits_is_refused_until_midnight() -> None:
    """Width 1: nine IDs a day; the tenth is day_exhausted, and the next day starts at 1 again."""
    store = await daily_store(step=4, policy=DailyPolicy.checked(1, "Asia/Shanghai"))
    clock = clock_at(60_000)
    allocator = await worker(store, clock)
    assert await take(allocator, clock, 9) == [20261127 * 10 + i for i in range(1, 10)]
    for _ in range(2):  # the first refusal and the next
        with pytest.raises(DayExhausted, match="9 IDs of 20261127") as info:
            await finish(clock, allocator.take("order", 1, clock.monotonic() + 2.0))
        assert info.value.code == "day_exhausted"
    fetches = store.calls
    assert allocator.try_take("order", 1) is None  # refused at once, no fetch
    assert store.calls == fetches
    await clock.advance(60.0)
    assert await take(allocator, clock, 1) == [202611281]


async def test_near_midnight_the_rate_sized_step_is_capped_at_what_the_day_can_use() -> None:
    """A sizer asking for a million IDs a second before midnight gets no more than the rest of the day needs."""
    store = await daily_store(step=10)
    clock = clock_at(1000)

    def huge(allocator: TagAllocator) -> int:
        return 1_000_000

    allocator = SegmentAllocator(store, clock, FAST, sizer=huge)
    await allocator.refresh()
    for _ in range(5):
        await take(allocator, clock, 10)
        await clock.advance(0.01)
    current = allocator.daily.tags["order"].current
    assert current is not None
    assert max(current.steps) < 100_000  # at ~1,000 IDs/s, a second left: a few thousand at most
    await clock.advance(1.0)  # the next day: the whole day ahead, the sizer's step again
    for _ in range(3):
        await take(allocator, clock, 10)
    current = allocator.daily.tags["order"].current
    assert current is not None
    assert max(current.steps) == 1_000_000


async def test_a_removed_daily_tag_is_forgotten_and_its_day_rows_stay_hidden() -> None:
    """Removing a daily tag stops it; its day rows are never listed as tags."""
    store = await daily_store()
    clock = clock_at(-1000)
    allocator = await worker(store, clock)
    await take(allocator, clock, 1)
    await store.remove_tag("order")
    await allocator.refresh()
    assert "order" not in allocator.daily.tags
    assert [info.tag for info in await store.list_tags()] == ["plain"]
    await allocator.close()


class WallClock(ManualClock):
    """Virtual time whose wall clock a test can also step back and forth (an NTP step, a worker behind)."""

    def step_wall(self, ms: int) -> None:
        self._wall_offset_ms += ms


steps = st.lists(
    st.tuples(st.integers(0, 1), st.integers(-1500, 2500), st.integers(1, 12)), min_size=1, max_size=20
)


@settings(deadline=None)
@given(ops=steps, behind=st.integers(0, 3000), width=st.sampled_from([1, 2, 6]), step=st.integers(1, 7))
def test_no_id_twice_across_days_whatever_the_workers_clocks_do(
    ops: list[tuple[int, int, int]], behind: int, width: int, step: int
) -> None:
    """Two workers, clocks apart and stepping back and forth across midnight: no ID twice, each of its date.

    Every ID answered carries the date of its worker's clock at the answer, and a day's counter never passes
    its width (the request is refused instead).
    """
    asyncio.run(_two_workers_stepping(ops, behind, DailyPolicy.checked(width, "Asia/Shanghai"), step))


async def _two_workers_stepping(
    ops: list[tuple[int, int, int]], behind: int, policy: DailyPolicy, step: int
) -> None:
    store = MemorySegmentStore()
    await store.add_tag("order", step, daily=policy)
    clocks = [WallClock(wall_ms=MIDNIGHT_MS - 1000), WallClock(wall_ms=MIDNIGHT_MS - 1000 - behind)]
    workers = [await worker(store, clock) for clock in clocks]
    seen: set[int] = set()
    for index, jump, count in ops:
        clock, allocator = clocks[index], workers[index]
        clock.step_wall(jump)
        before = day_of(clock.wall_ms(), policy.zone)
        try:
            batch = allocator.try_take("order", count)  # buffered: at once, as most requests are
            got = ids(batch) if batch is not None else await take(allocator, clock, count)
        except DayExhausted:
            continue
        after = day_of(clock.wall_ms(), policy.zone)
        for i in got:
            day, counter = split(i, policy.width)
            assert day in {before, after}
            assert 1 <= counter <= policy.capacity
            assert i not in seen
            seen.add(i)
    for allocator in workers:
        await allocator.close()


async def test_a_new_width_takes_effect_at_the_next_refresh_and_the_days_counter_goes_on() -> None:
    """Width 6 to 8 mid-day: the next IDs have the new width, their counter continues the day's row."""
    store = await daily_store(step=10)
    clock = clock_at(-1000)
    allocator = await worker(store, clock)
    assert await take(allocator, clock, 2) == [20261128000001, 20261128000002]
    await store.set_daily("order", DailyPolicy.checked(8, "Asia/Shanghai"))
    await allocator.refresh()
    (got,) = await take(allocator, clock, 1)
    assert len(str(got)) == 16  # eight digits of date, eight of counter
    day, counter = split(got, 8)
    assert day == 20261128
    assert counter > 2  # a new segment of the same row: the day's counter goes on
    await allocator.close()


async def test_a_daily_tag_removed_under_a_worker_is_unknown_at_its_next_day() -> None:
    """Removed between two refreshes: today's row still serves; the next day's cannot open, and the tag is forgotten."""
    store = await daily_store(step=2)
    clock = clock_at(100)
    allocator = await worker(store, clock)
    assert await take(allocator, clock, 1) == [20261127000001]
    await store.remove_tag("order")
    await clock.advance(0.2)  # midnight: the new day's row would have to be opened
    with pytest.raises(UnknownTag):
        await finish(clock, allocator.take("order", 1, clock.monotonic() + 2.0))
    assert "order" not in allocator.daily.tags
    assert "order@20261128" not in {info.tag for info in await store.list_tags()}
    await allocator.close()
