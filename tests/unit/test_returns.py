"""The unused rest of a worker's segments, returned on a clean stop (service/returns.py), on the memory store."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.core.errors import StoreUnavailable
from dispenser.core.residue import Residue
from dispenser.service.returns import return_unused
from dispenser.service.segments import SegmentAllocator
from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import MemorySegmentStore
from tests.unit.returns_support import FAST, SlowReplyStore


async def worker(store: MemorySegmentStore, clock: ManualClock) -> SegmentAllocator:
    allocator = SegmentAllocator(store, clock, FAST)
    await allocator.refresh()
    return allocator


async def ids_of(allocator: SegmentAllocator, clock: ManualClock, tag: str, count: int) -> list[int]:
    batch = await allocator.take(tag, count, clock.monotonic() + 1)
    return [i for first, last in batch.ranges for i in range(first, last + 1)]


async def test_the_next_worker_hands_out_the_rest_first_and_no_id_twice() -> None:
    """37 IDs of [1, 100] used and [101, 200] buffered: both rests returned, the next worker starts at 38."""
    clock, store = ManualClock(), MemorySegmentStore()
    await store.add_tag("order", 100)
    first = await worker(store, clock)
    handed = await ids_of(first, clock, "order", 37)
    await settle()  # the prefetch of [101, 200] lands
    returned = await return_unused(first, store, "a", clock, 2.0)
    assert (returned.offered, returned.kept, returned.tags) == (163, 163, 1)
    second = await worker(store, clock)
    handed += await ids_of(second, clock, "order", 250)
    assert handed == list(range(1, 288))  # nothing lost, nothing twice
    await second.close()


async def test_a_stopped_worker_hands_out_nothing_after_its_return() -> None:
    """The buffer is closed before its rest is read: a take after the return fails, it never serves those IDs."""
    clock, store = ManualClock(), MemorySegmentStore()
    await store.add_tag("order", 100)
    first = await worker(store, clock)
    await ids_of(first, clock, "order", 10)
    await return_unused(first, store, "a", clock, 2.0)
    assert first.try_take("order", 1) is None
    with pytest.raises(StoreUnavailable):
        await first.take("order", 1, clock.monotonic() + 1)


async def test_a_fetch_in_flight_at_the_stop_is_returned_never_served() -> None:
    """A segment that arrives after the buffer closed lands, is never handed out, and goes back with the rest."""
    clock, store = ManualClock(), SlowReplyStore()
    await store.add_tag("order", 100)
    first = await worker(store, clock)
    store.gate.clear()
    waiting = asyncio.ensure_future(first.take("order", 5, clock.monotonic() + 10))
    await settle()
    stopping = asyncio.ensure_future(return_unused(first, store, "a", clock, 2.0))
    await settle()
    store.gate.set()
    returned = await stopping
    assert (returned.offered, returned.kept) == (100, 100)
    with pytest.raises(StoreUnavailable):
        await waiting
    second = await worker(store, clock)
    assert await ids_of(second, clock, "order", 101) == list(range(1, 102))  # [1, 100] granted in flight


async def test_a_live_worker_above_a_returned_range_leaves_it_to_a_new_one() -> None:
    """A worker's IDs keep increasing: the range returned below its buffer waits for a fresh worker."""
    clock, store = ManualClock(), MemorySegmentStore()
    await store.add_tag("order", 100)
    stopping, live = await worker(store, clock), await worker(store, clock)
    assert await ids_of(stopping, clock, "order", 1) == [1]
    await settle()  # its next, [101, 200], lands
    assert await ids_of(live, clock, "order", 1) == [201]
    await settle()  # [301, 400]
    await return_unused(stopping, store, "a", clock, 2.0)
    handed = await ids_of(live, clock, "order", 299)
    assert handed == list(range(202, 501))  # [2, 100] and [101, 200] left below it
    fresh = await worker(store, clock)
    assert await ids_of(fresh, clock, "order", 102) == list(range(2, 104))


async def test_a_tag_of_a_residue_class_returns_its_own_ids() -> None:
    """IDs 1 modulo 4: the rest goes back as IDs of the class and comes back as the same IDs."""
    clock, store = ManualClock(), MemorySegmentStore()
    await store.add_tag("order", 10, residue=Residue(4, 1))
    first = await worker(store, clock)
    handed = await ids_of(first, clock, "order", 3)
    await return_unused(first, store, "a", clock, 2.0)
    second = await worker(store, clock)
    handed += await ids_of(second, clock, "order", 7)
    assert handed == [1 + 4 * k for k in range(10)]
