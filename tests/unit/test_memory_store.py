"""The in-memory store's test knobs: failures on demand, the round-trip counter, the delay, the clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from dispenser.core.errors import StoreUnavailable
from dispenser.core.segment import Segment
from dispenser.testing.fakes import MemorySegmentStore


async def test_set_unavailable_fails_every_call_until_cleared() -> None:
    """set_unavailable() makes calls raise StoreUnavailable without moving the tag; clearing it restores."""
    store = MemorySegmentStore()
    await store.add_tag("order", step=10)
    store.set_unavailable()
    with pytest.raises(StoreUnavailable):
        await store.next_segment("order")
    with pytest.raises(StoreUnavailable):
        await store.list_tags()
    store.set_unavailable(False)
    assert (await store.next_segment("order")).segment == Segment(1, 10)


async def test_fail_with_raises_the_given_exception() -> None:
    """fail_with raises exactly the exception set, every time, without growing its traceback."""
    store = MemorySegmentStore()
    await store.add_tag("order", step=10)
    boom = RuntimeError("boom")
    store.fail_with = boom
    depths = []
    for _ in range(3):
        with pytest.raises(RuntimeError) as info:
            await store.next_segment("order")
        assert info.value is boom
        tb, depth = info.value.__traceback__, 0
        while tb is not None:
            tb, depth = tb.tb_next, depth + 1
        depths.append(depth)
    assert depths[0] == depths[-1]


async def test_calls_counts_round_trips_including_failures() -> None:
    """Calls counts every next_segment that would reach the database, failed ones included."""
    store = MemorySegmentStore()
    await store.add_tag("order", step=10)
    await store.next_segment("order")
    store.set_unavailable()
    with pytest.raises(StoreUnavailable):
        await store.next_segment("order")
    assert store.calls == 2


async def test_delay_lets_concurrent_calls_overlap() -> None:
    """With a delay, concurrent calls are in flight together yet still get disjoint segments."""
    store = MemorySegmentStore()
    store.delay = 0.05
    await store.add_tag("order", step=10)
    loop = asyncio.get_running_loop()
    start = loop.time()
    allocations = await asyncio.gather(*(store.next_segment("order") for _ in range(10)))
    assert loop.time() - start < 0.4
    assert sorted(a.segment.first for a in allocations) == list(range(1, 101, 10))


async def test_update_time_comes_from_the_clock() -> None:
    """update_time is stamped from the clock passed in."""
    moment = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    store = MemorySegmentStore(now=lambda: moment)
    info = await store.add_tag("order", step=10)
    assert info.update_time == moment
