"""A worker's operations: what ``/metrics``, ``/healthz`` and ``/readyz`` read, and their own port.

``metrics.port`` gets a server of its own, unless it is ``http.port``: then the HTTP API's server answers
them too (:mod:`dispenser.app.http`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from dispenser.adapters.http import HttpServer, Operations
from dispenser.adapters.kafka.requests import KafkaRequestService
from dispenser.adapters.prometheus import exposition, worker_registry
from dispenser.config import Config
from dispenser.ports import Clock
from dispenser.service.dispatch import Dispatcher
from dispenser.service.rates import RateBook
from dispenser.service.segments import SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator
from dispenser.status import ClockCheck, RecentErrors, StatusPage

__all__ = ["Observed", "metrics_on_http_port", "operations", "start_metrics", "status_page"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under

_PROBE_CONNECTIONS = 128
"""Open connections to the metrics port at once: probes and scrapers, a handful in practice."""


@dataclass(slots=True)
class Observed:
    """What ``/metrics`` reads of a worker (:class:`dispenser.adapters.prometheus.Worker`).

    Built when the metrics port opens, before the serving parts start: the Kafka service is added once it
    is up (``None`` until then, and for good when Kafka requests are not served).
    """

    clock: Clock
    rates: RateBook
    dispatchers: Mapping[str, Dispatcher]
    allocator: SegmentAllocator | None
    snowflake: SnowflakeGenerator | None
    kafka: KafkaRequestService | None = field(default=None)

    def add_kafka(self, kafka: KafkaRequestService) -> None:
        """The Kafka request service, from its creation on."""
        self.kafka = kafka


def operations(
    observed: Observed,
    not_ready: Callable[[], Sequence[str]],
    cannot_issue: Callable[[], Sequence[str]],
    status: StatusPage | None = None,
) -> tuple[CollectorRegistry, Operations]:
    """What ``/metrics`` (its registry: ``dispenser enrich`` adds the enricher's), the probes, ``/status`` read.

    ``status``: the status page, served beside ``/metrics`` (``None``: off, ``metrics.status_page``).
    """
    registry = worker_registry(observed)
    return registry, Operations(
        metrics=lambda: exposition(registry), not_ready=not_ready, cannot_issue=cannot_issue, status=status
    )


def status_page(
    config: Config,
    observed: Observed,
    not_ready: Callable[[], Sequence[str]],
    cannot_issue: Callable[[], Sequence[str]],
    *,
    clock_check: ClockCheck | None,
    recent_errors: RecentErrors,
) -> StatusPage | None:
    """The status page of the worker ``observed`` is (``None``: ``metrics.status_page`` is off)."""
    if not config.metrics.status_page:
        return None
    return StatusPage(
        observed,
        not_ready=not_ready,
        cannot_issue=cannot_issue,
        clock_check=clock_check,
        recent_errors=recent_errors,
        snowflake_mode=config.snowflake.mode,
    )


def metrics_on_http_port(config: Config, *, serve: bool) -> bool:
    """Whether ``metrics.port`` is ``http.port``: then the HTTP API's server serves ``/metrics`` too."""
    port = config.metrics.port
    return bool(serve and port and port == config.http.port)


async def start_metrics(
    stack: contextlib.AsyncExitStack, config: Config, port: int, ops: Operations
) -> HttpServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on a port of their own (``metrics.port``)."""
    # A small cap of its own: the probes' port never shares the fate of the API's sockets.
    server = HttpServer(config.metrics.host, port, ops, max_connections=_PROBE_CONNECTIONS)
    stack.push_async_callback(server.stop)
    await server.start()
    status = " and /status" if ops.status is not None else ""
    log.info("serving Prometheus metrics on %s/metrics (and /healthz, /readyz%s)", server.url, status)
    return server
