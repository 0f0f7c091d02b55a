"""/metrics of a worker: the conditions docs/alerts.yml alerts on show up in what the collector exposes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispenser import __version__
from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.adapters.prometheus import EnricherCollector, add_standard_collectors
from dispenser.core.daily import DailyPolicy
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


def test_the_enrichers_counters_and_lag_by_partition() -> None:
    """leaf_enrich_* show the enricher's committed records, dead letters, transactions and lag per partition."""

    @dataclass
    class Stats:
        enriched: int = 990
        dead_lettered: int = 10
        transactions: int = 7
        aborted: int = 2
        id_waits: int = 1

    @dataclass
    class Enricher:
        stats: Stats = field(default_factory=Stats)
        behind: dict[int, int] = field(default_factory=lambda: {1: 40, 0: 3})

        def lag(self) -> dict[int, int]:
            return self.behind

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EnricherCollector(Enricher(), "orders"))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    topic = (("topic", "orders"),)
    assert samples[("leaf_enrich_records_total", topic)] == 990
    assert samples[("leaf_enrich_dead_letters_total", topic)] == 10
    assert samples[("leaf_enrich_transactions_committed_total", topic)] == 7
    assert samples[("leaf_enrich_transactions_aborted_total", topic)] == 2
    assert samples[("leaf_enrich_id_waits_total", topic)] == 1
    assert samples[("leaf_enrich_lag_records", (("partition", "0"), *topic))] == 3
    assert samples[("leaf_enrich_lag_records", (("partition", "1"), *topic))] == 40


def test_the_standard_collectors_and_build_info_are_registered() -> None:
    """A worker's registry has process_*, python_info, python_gc_* and leaf_build_info{version} = 1."""
    registry = CollectorRegistry(auto_describe=False)
    add_standard_collectors(registry)
    names = {
        sample.name: sample
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"} <= set(names)
    assert any(name.startswith("python_gc_") for name in names)
    assert names["leaf_build_info"].labels == {"version": __version__}
    assert names["leaf_build_info"].value == 1


async def test_a_daily_tag_shows_under_its_own_name() -> None:
    """A daily tag's segment metrics are its current day row's, labelled with the tag (not 'order@YYYYMMDD')."""
    clock = ManualClock()
    store = MemorySegmentStore()
    await store.add_tag("order", 10, daily=DailyPolicy.checked(6, "UTC"))
    allocator = SegmentAllocator(store, clock, AllocatorSettings())
    await allocator.refresh()
    target = worker(clock, allocator=allocator)
    taking = asyncio.ensure_future(allocator.take("order", 3, clock.monotonic() + 1))
    await clock.run_until(taking.done)
    await taking
    scraped = scrape(target)
    assert scraped[("leaf_segment_fetches_total", (("tag", "order"),))] >= 1
    assert scraped[("leaf_ids_buffered", (("tag", "order"),))] >= 7
    assert not [key for key in scraped if any("@" in value for _, value in key[1])]
    await allocator.close()
