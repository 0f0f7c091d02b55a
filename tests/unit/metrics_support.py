"""A worker as the Prometheus collector sees it, built from the real services on virtual time, and its scrape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispenser.adapters.local.static_registry import StaticRegistry
from dispenser.adapters.prometheus import KafkaRequests, WorkerCollector
from dispenser.core.step import StepPolicy
from dispenser.service.dispatch import Dispatcher
from dispenser.service.rates import RateBook, RateSettings
from dispenser.service.segments import SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator
from dispenser.testing.clock import ManualClock

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""A scrape: each sample's value by metric name and sorted labels."""


class SteppedClock(ManualClock):
    """A manual clock whose wall clock can be stepped back alone (an NTP step), as the soak's faketime does."""

    def __init__(self) -> None:
        super().__init__()
        self.wall_step_ms = 0

    def wall_ms(self) -> int:
        return super().wall_ms() + self.wall_step_ms


class LosableRegistry(StaticRegistry):
    """A static registry whose lease the test can take away (as ``zookeeper-lease`` loses its claim)."""

    held = True

    def can_issue(self) -> bool:
        return self.held


@dataclass
class KafkaCounts:
    undeliverable: int = 0


@dataclass
class FakeKafka:
    stats: KafkaCounts = field(default_factory=KafkaCounts)


@dataclass
class FakeWorker:
    """What the collector reads of a worker (``dispenser.app.Worker`` has the same, from the wiring)."""

    clock: ManualClock
    rates: RateBook
    allocator: SegmentAllocator | None = None
    snowflake: SnowflakeGenerator | None = None
    kafka: KafkaRequests | None = None
    dispatchers: Mapping[str, Dispatcher] = field(default_factory=dict)


def rate_book(clock: ManualClock) -> RateBook:
    return RateBook(clock, RateSettings(), StepPolicy())


def scrape(worker: FakeWorker) -> Samples:
    """The samples /metrics would show (the text format, parsed back)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
