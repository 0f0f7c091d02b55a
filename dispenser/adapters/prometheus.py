"""Prometheus: ``/metrics`` of one worker, read from the worker's own counters when scraped.

Nothing is counted for Prometheus on the hot path: a custom collector reads, at scrape time, what the
worker counts anyway (the rate meters, the dispatchers' answers and errors, the allocators' fetches and
buffers, the snowflake generator's waits). The endpoint is a small asyncio server in the worker's own
event loop, so a scrape reads a consistent state and needs no thread.

Metrics (all prefixed ``leaf_``): ``ids_total`` and ``requests_total`` by kind and tag; ``errors_total`` and
``request_seconds`` (histogram) and ``replays_unsettled_total`` by kind; ``segment_fetches_total``,
``segment_fetch_seconds_total``, ``segment_fetch_errors_total``, ``segment_step``, ``segment_configured_step``,
``ids_buffered``, ``runway_seconds``, ``rate_ids_per_second`` and ``peak_ids_per_second`` by tag;
``snowflake_clock_waits_total``, ``snowflake_rollbacks_refused_total``, ``snowflake_clock_back_waits_total``
and ``snowflake_lease_held``; ``kafka_replies_undeliverable_total`` when Kafka requests are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dispenser.core.rate import runway_seconds
from dispenser.ports import Clock
from dispenser.service.dispatch import LATENCY_BUCKETS, Dispatcher
from dispenser.service.rates import RateBook
from dispenser.service.segments import SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator

__all__ = ["MetricsServer", "WorkerCollector"]

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


class Worker(Protocol):
    """What the metrics read of a worker (:class:`dispenser.app.Worker` has it all)."""

    @property
    def clock(self) -> Clock:
        """The worker's clock."""
        ...

    @property
    def rates(self) -> RateBook:
        """Its rate meters."""
        ...

    @property
    def dispatchers(self) -> Mapping[str, Dispatcher]:
        """Its dispatchers by kind."""
        ...

    @property
    def allocator(self) -> SegmentAllocator | None:
        """Its segment allocator, if segments are on."""
        ...

    @property
    def snowflake(self) -> SnowflakeGenerator | None:
        """Its snowflake generator, if snowflake is on."""
        ...

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
        for tag, tag_allocator in list(allocator.tags.items()):
            fetches.add_metric([tag], tag_allocator.fetches)
            fetch_time.add_metric([tag], tag_allocator.fetch_seconds)
            fetch_errors.add_metric([tag], tag_allocator.fetch_errors)
            step.add_metric([tag], tag_allocator.last_step or 0)
            floor.add_metric([tag], tag_allocator.step or 0)
            left = tag_allocator.buffer.remaining
            buffered.add_metric([tag], left)
            meter = tag_allocator.meter
            runway.add_metric([tag], runway_seconds(left, meter.peak(now) or meter.rate(now)))
        yield from (fetches, fetch_time, fetch_errors, step, floor, buffered, runway)


class MetricsServer:
    """``GET /metrics`` on ``host:port``, served from the worker's event loop."""

    def __init__(self, worker: Worker, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WorkerCollector(worker))
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen (port 0 picks a free one; :attr:`port` then says which)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("serving Prometheus metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            target = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
            if request.startswith(b"GET ") and target.split(b"?")[0] in (b"/metrics", b"/"):
                body, status = generate_latest(self.registry), b"200 OK"
                kind = b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, kind = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + kind
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
