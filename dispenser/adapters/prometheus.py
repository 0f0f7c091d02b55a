"""Prometheus: ``/metrics`` of one worker, read from the worker's own counters when scraped.

Nothing is counted for Prometheus on the hot path: a custom collector reads, at scrape time, what the
worker counts anyway; :class:`EnricherCollector` does the same for ``dispenser enrich``. The metrics:
``docs/operations.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from dispenser import __version__
from dispenser.core.rate import runway_seconds
from dispenser.service.dispatch import LATENCY_BUCKETS
from dispenser.service.observed import ObservedWorker

__all__ = [
    "BuildInfoCollector",
    "EnricherCollector",
    "WorkerCollector",
    "add_standard_collectors",
    "exposition",
    "merge_expositions",
    "worker_registry",
]

log = logging.getLogger(__name__)


class KafkaRequestCounts(Protocol):
    """What the metrics read of the Kafka request service's counters."""

    @property
    def undeliverable(self) -> int:
        """Replies dropped because they could not be delivered."""
        ...


class KafkaRequests(Protocol):
    """The Kafka request service, as the metrics see it."""

    @property
    def stats(self) -> KafkaRequestCounts:
        """Its counters."""
        ...


class Worker(ObservedWorker, Protocol):
    """What the metrics read of a worker: what every observer reads, and its Kafka request service."""

    @property
    def kafka(self) -> KafkaRequests | None:
        """Its Kafka request service, if Kafka requests are served."""
        ...


class WorkerCollector(Collector):
    """Reads one worker's state into Prometheus metric families."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        """The metric families, now."""
        worker = self._worker
        now = worker.clock.monotonic()
        ids = CounterMetricFamily("leaf_ids", "IDs handed out", labels=["kind", "tag"])
        requests = CounterMetricFamily("leaf_requests", "Batches of IDs handed out", labels=["kind", "tag"])
        rate = GaugeMetricFamily(
            "leaf_rate_ids_per_second", "IDs/s over the rate window", labels=["kind", "tag"]
        )
        peak = GaugeMetricFamily(
            "leaf_peak_ids_per_second", "Highest window average kept", labels=["kind", "tag"]
        )
        for (kind, tag), meter in worker.rates.meters():
            ids.add_metric([kind, tag], meter.ids_issued)
            requests.add_metric([kind, tag], meter.requests_issued)
            rate.add_metric([kind, tag], meter.rate(now))
            peak.add_metric([kind, tag], meter.peak(now))
        yield from (ids, requests, rate, peak)
        yield from self._dispatch()
        yield from self._segments(now)
        snowflake = worker.snowflake
        if snowflake is not None:
            yield CounterMetricFamily(
                "leaf_snowflake_clock_waits",
                "Waits for the next millisecond or a small rollback",
                snowflake.clock_waits,
            )
            yield CounterMetricFamily(
                "leaf_snowflake_rollbacks_refused",
                "Takes refused: the clock went back too far",
                snowflake.rollbacks_refused,
            )
            yield CounterMetricFamily(
                "leaf_snowflake_clock_back_waits",
                "Small clock rollbacks seen and waited out (the clock did go back)",
                snowflake.clock_back_waits,
            )
            yield GaugeMetricFamily(
                "leaf_snowflake_lease_held",
                "1 while the worker may issue under its worker ID; 0 from a lost lease until it registers again",
                1 if snowflake.holds_lease else 0,
            )
        kafka = worker.kafka
        if kafka is not None:
            yield CounterMetricFamily(
                "leaf_kafka_replies_undeliverable",
                "Kafka replies dropped: no such reply topic or partition, or still failing at the request's max age",
                kafka.stats.undeliverable,
            )

    def _dispatch(self) -> Iterator[Metric]:
        errors = CounterMetricFamily("leaf_errors", "Error replies", labels=["kind", "code"])
        latency = HistogramMetricFamily(
            "leaf_request_seconds",
            "Request latency in the worker (inline answers count as under 1 ms)",
            labels=["kind"],
        )
        for kind, dispatcher in self._worker.dispatchers.items():
            for code, count in dispatcher.errors.items():
                errors.add_metric([kind, code], count)
            cumulative, buckets = dispatcher.inline, []
            for bound, count in zip((*LATENCY_BUCKETS, math.inf), dispatcher.waited, strict=True):
                cumulative += count
                buckets.append(("+Inf" if math.isinf(bound) else str(bound), cumulative))
            latency.add_metric([kind], buckets, dispatcher.waited_seconds)
        unsettled = CounterMetricFamily(
            "leaf_replays_unsettled",
            "Answers to a request_id given while the fleet-wide replay store was down (idempotent on this "
            "worker only)",
            labels=["kind"],
        )
        for kind, dispatcher in self._worker.dispatchers.items():
            unsettled.add_metric([kind], dispatcher.replays_unsettled)
        yield errors
        yield latency
        yield unsettled

    def _segments(self, now: float) -> Iterator[Metric]:
        allocator = self._worker.allocator
        if allocator is None:
            return
        fetches = CounterMetricFamily(
            "leaf_segment_fetches", "Segments fetched (one round trip each)", labels=["tag"]
        )
        fetch_time = CounterMetricFamily(
            "leaf_segment_fetch_seconds", "Time spent fetching segments", labels=["tag"]
        )
        fetch_errors = CounterMetricFamily(
            "leaf_segment_fetch_errors",
            "Segment fetches that failed (the store unreachable or refusing; retried)",
            labels=["tag"],
        )
        step = GaugeMetricFamily("leaf_segment_step", "Size of the last segment fetched", labels=["tag"])
        floor = GaugeMetricFamily("leaf_segment_configured_step", "The tag's leaf_alloc.step", labels=["tag"])
        buffered = GaugeMetricFamily("leaf_ids_buffered", "IDs in this worker's buffers", labels=["tag"])
        runway = GaugeMetricFamily(
            "leaf_runway_seconds",
            "Seconds the buffers last at the peak rate without the database",
            labels=["tag"],
        )
        # A daily tag by its own name, from its current day's allocator: its counters start again each
        # day (a counter reset, as a restart is to Prometheus).
        for tag, tag_allocator in [*allocator.tags.items(), *allocator.daily.current()]:
            fetches.add_metric([tag], tag_allocator.fetches)
            fetch_time.add_metric([tag], tag_allocator.fetch_seconds)
            fetch_errors.add_metric([tag], tag_allocator.fetch_errors)
            step.add_metric([tag], tag_allocator.last_step or 0)
            floor.add_metric([tag], tag_allocator.step or 0)
            left = tag_allocator.buffer.remaining
            buffered.add_metric([tag], left)
            meter = tag_allocator.meter
            # At the peak, or at the current rate while higher (a rise, or a burst, not yet sustained).
            runway.add_metric([tag], runway_seconds(left, max(meter.peak(now), meter.rate(now))))
        yield from (fetches, fetch_time, fetch_errors, step, floor, buffered, runway)


class EnrichCounts(Protocol):
    """What the metrics read of the enricher's counters (``EnrichStats``)."""

    @property
    def enriched(self) -> int:
        """Records enriched, counted when their transaction committed."""
        ...

    @property
    def dead_lettered(self) -> int:
        """Records sent to the dead-letter topic (committed)."""
        ...

    @property
    def transactions(self) -> int:
        """Transactions committed."""
        ...

    @property
    def aborted(self) -> int:
        """Transactions aborted (the partition starts over from its last commit)."""
        ...

    @property
    def id_waits(self) -> int:
        """Times taking IDs failed and was retried."""
        ...


class EnricherState(Protocol):
    """The enricher (``dispenser enrich``), as the metrics see it."""

    @property
    def stats(self) -> EnrichCounts:
        """Its counters."""
        ...

    def lag(self) -> Mapping[int, int]:
        """Records behind, by owned input partition."""
        ...


class EnricherCollector(Collector):
    """``leaf_enrich_*``: what ``dispenser enrich`` did, and how far behind its input it is."""

    def __init__(self, enricher: EnricherState, input_topic: str) -> None:
        self._enricher = enricher
        self._topic = input_topic

    def collect(self) -> Iterator[Metric]:
        """The metric families, now."""
        stats = self._enricher.stats
        topic = [self._topic]
        families = (
            CounterMetricFamily(
                "leaf_enrich_records",
                "Records enriched (counted when their transaction commits)",
                labels=["topic"],
            ),
            CounterMetricFamily(
                "leaf_enrich_dead_letters", "Records sent to the dead-letter topic", labels=["topic"]
            ),
            CounterMetricFamily(
                "leaf_enrich_transactions_committed", "Transactions committed", labels=["topic"]
            ),
            CounterMetricFamily(
                "leaf_enrich_transactions_aborted",
                "Transactions aborted (redone from the last commit)",
                labels=["topic"],
            ),
            CounterMetricFamily(
                "leaf_enrich_id_waits", "Times taking IDs failed and was retried", labels=["topic"]
            ),
        )
        values = (stats.enriched, stats.dead_lettered, stats.transactions, stats.aborted, stats.id_waits)
        for family, value in zip(families, values, strict=True):
            family.add_metric(topic, value)
            yield family
        lag = GaugeMetricFamily(
            "leaf_enrich_lag_records",
            "Input records not yet read, by owned partition (last stable offset minus the next to read)",
            labels=["topic", "partition"],
        )
        for partition, behind in sorted(self._enricher.lag().items()):
            lag.add_metric([self._topic, str(partition)], behind)
        yield lag


def worker_registry(worker: Worker) -> CollectorRegistry:
    """A registry of the worker's metrics, the standard ones (process, platform, GC) and ``leaf_build_info``.

    Served by :class:`dispenser.adapters.http.HttpServer` (``/metrics`` on ``metrics.port``, and on
    ``http.port``): :func:`exposition` renders it.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    add_standard_collectors(registry)
    return registry


def add_standard_collectors(registry: CollectorRegistry) -> None:
    """Register what every Prometheus client exports by default, and ``leaf_build_info``.

    ``process_*`` (CPU, memory, open files, start time; Linux), ``python_info``, ``python_gc_*``: the
    default registry's collectors, registered here on our own registry (which a worker in a test shares
    the process with others, so it is never the global default one).
    """
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(BuildInfoCollector())


class BuildInfoCollector(Collector):
    """``leaf_build_info{version}`` 1: which release runs (joined onto other metrics by instance)."""

    def collect(self) -> Iterator[Metric]:
        """The one sample."""
        info = GaugeMetricFamily(
            "leaf_build_info", "The running release (always 1; the version in its label)", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format (what ``/metrics`` answers)."""
    return generate_latest(registry)


class _Families(Collector):
    """Metric families already read (the processes' expositions, merged)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        """The families as given."""
        return iter(self._families)


def merge_expositions(
    texts: Mapping[str, str], *, restarts: Mapping[str, int], processes: int, label: str = "process"
) -> bytes:
    """One exposition for the host from its worker processes' (``dispenser serve --processes``).

    Each process's samples keep their names and labels and gain ``label`` (its index); a family several
    processes expose is one family. Then the supervisor's own: the processes configured, and each one's
    restarts and whether it serves now (it is in ``texts``).

    Args:
        texts: each serving process's ``/metrics`` text, by process index.
        restarts: restarts by the supervisor so far, by process index (every process).
        processes: how many processes the host runs.
        label: the label naming the process.
    """
    families: dict[str, Metric] = {}
    for process, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            merged.samples.extend(
                Sample(s.name, {**s.labels, label: process}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    configured = GaugeMetricFamily("leaf_worker_processes", "Worker processes this host runs")
    configured.add_metric([], processes)
    serving = GaugeMetricFamily(
        "leaf_worker_process_serving",
        "1 while the process serves, 0 while it starts or restarts",
        labels=[label],
    )
    restarted = CounterMetricFamily(
        "leaf_worker_process_restarts", "Times the supervisor restarted the process", labels=[label]
    )
    for process, count in restarts.items():
        serving.add_metric([process], 1 if process in texts else 0)
        restarted.add_metric([process], count)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), configured, serving, restarted]))
    return generate_latest(registry)
