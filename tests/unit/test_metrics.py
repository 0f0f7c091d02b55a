"""/metrics of a worker: the conditions docs/alerts.yml alerts on show up in what the collector exposes."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.core.errors import ClockMovedBackwards, LeaseLost, StoreUnavailable
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.ports import WorkerLease
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings
from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import MemorySegmentStore
from tests.unit.metrics_support import FakeWorker, LosableRegistry, SteppedClock, rate_book, scrape

LAYOUT = SnowflakeLayout()


def worker(
    clock: ManualClock,
    *,
    allocator: SegmentAllocator | None = None,
    snowflake: SnowflakeGenerator | None = None,
) -> FakeWorker:
    return FakeWorker(clock, rate_book(clock), allocator, snowflake)


async def test_failed_segment_fetches_are_counted_per_tag() -> None:
    """leaf_segment_fetch_errors_total counts every failed round trip of a tag, and stops when the store is back."""
    clock = ManualClock()
    store = MemorySegmentStore()
    await store.add_tag("order", 10)
    allocator = SegmentAllocator(store, clock, AllocatorSettings(retry_initial=0.01, retry_max=0.02))
    await allocator.refresh()
    target = worker(clock, allocator=allocator)
    errors = ("leaf_segment_fetch_errors_total", (("tag", "order"),))
    await allocator.take("order", 1, clock.monotonic() + 1)
    assert scrape(target)[errors] == 0
    store.set_unavailable()
    taking = asyncio.ensure_future(allocator.take("order", 25, clock.monotonic() + 0.1))
    await clock.run_until(taking.done)
    with pytest.raises(StoreUnavailable):
        await taking
    failed = scrape(target)[errors]
    assert failed >= 2  # retried, each attempt counted
    store.set_unavailable(False)
    taking = asyncio.ensure_future(allocator.take("order", 25, clock.monotonic() + 1))
    await clock.run_until(taking.done)
    await taking
    await clock.advance(1.0)
    assert scrape(target)[errors] - failed <= 1  # at most the attempt under way when the store came back
    assert scrape(target)[("leaf_segment_fetches_total", (("tag", "order"),))] >= 3
    await allocator.close()


async def test_clock_rollbacks_are_counted_whether_waited_out_or_refused() -> None:
    """A small step back is waited out and counted; a large one is refused and counted; steps forward are not."""
    clock = SteppedClock()
    registry = StaticRegistry(5, max_worker_id=LAYOUT.max_worker_id)
    await registry.register()
    generator = SnowflakeGenerator(
        LAYOUT, WorkerLease(5, 0), registry, clock, _no_persist, settings=SnowflakeSettings(random_start=0)
    )
    await generator.start()
    target = worker(clock, snowflake=generator)
    waited, refused = "leaf_snowflake_clock_back_waits_total", "leaf_snowflake_rollbacks_refused_total"
    await generator.take("t", 1, clock.monotonic() + 1)
    await clock.advance(0.010)
    await generator.take("t", 1, clock.monotonic() + 1)
    assert (scrape(target)[(waited, ())], scrape(target)[(refused, ())]) == (0, 0)
    clock.wall_step_ms = -3  # within max_backward_ms (5): waited out (twice the offset)
    taking = asyncio.ensure_future(generator.take("t", 1, clock.monotonic() + 1))
    await clock.run_until(taking.done)
    await taking
    assert (scrape(target)[(waited, ())], scrape(target)[(refused, ())]) == (1, 0)
    clock.wall_step_ms = -1_000  # far more: refused
    with pytest.raises(ClockMovedBackwards):
        await generator.take("t", 1, clock.monotonic() + 1)
    assert (scrape(target)[(waited, ())], scrape(target)[(refused, ())]) == (1, 1)
    await generator.stop()


async def test_a_lost_lease_shows_until_the_worker_registers_again() -> None:
    """leaf_snowflake_lease_held is 1 while IDs may be issued, 0 from a lost lease until re-registered."""
    clock = ManualClock()
    registry = LosableRegistry(5, max_worker_id=LAYOUT.max_worker_id)
    await registry.register()
    generator = SnowflakeGenerator(
        LAYOUT,
        WorkerLease(5, 0),
        registry,
        clock,
        _no_persist,
        settings=SnowflakeSettings(report_interval=3600),
    )
    await generator.start()
    target = worker(clock, snowflake=generator)
    held = ("leaf_snowflake_lease_held", ())
    assert scrape(target)[held] == 1
    registry.held = False
    assert scrape(target)[held] == 0
    with pytest.raises(LeaseLost):
        generator.try_take("t", 1)
    registry.held = True  # the registry vouches again, but the generator has not re-registered yet
    await clock.run_until(lambda: scrape(target)[held] == 1)
    await settle()
    assert generator.try_take("t", 1) is not None
    await generator.stop()


async def _no_persist(_worker_id: int, _high_water_ms: int) -> None:
    return None
