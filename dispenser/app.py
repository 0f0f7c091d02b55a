"""Wiring: builds the running worker from a :class:`Config`, and runs it until a signal arrives."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping

import msgspec
from prometheus_client import CollectorRegistry

from dispenser.adapters.http import HttpServer, LeafApi, Operations
from dispenser.adapters.http.access import HttpAccess
from dispenser.adapters.http.guard import FD_RESERVE, raise_open_files_limit
from dispenser.adapters.kafka.connection import check_security
from dispenser.adapters.kafka.enrich import Enricher, EnrichSettings
from dispenser.adapters.kafka.rates import KafkaRateListener, KafkaRateSink
from dispenser.adapters.kafka.requests import KafkaRequestService
from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.nats.connection import Connection, connect, drain
from dispenser.adapters.nats.rates import rate_sink, subscribe_rates
from dispenser.adapters.nats.service import NatsIdService, SpecialHandler
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.adapters.prometheus import EnricherCollector, exposition, worker_registry
from dispenser.config import Config
from dispenser.core.errors import DispenserError
from dispenser.core.step import StepPolicy
from dispenser.messages import DECODE_TAG, Kind, id_subject
from dispenser.ports import Clock, IdSource, ReplayStore, SegmentStore, SystemClock
from dispenser.readiness import cannot_issue, not_ready
from dispenser.redaction import redact
from dispenser.registries import SnowflakeRegistration, layout_of
from dispenser.service.decode import decode_handler, decode_id
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.identity import IdentityGuard
from dispenser.service.rates import EventSink, RateBook, RatePublisher, RateSettings
from dispenser.service.residues import ResidueGuard
from dispenser.service.segments import SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator
from dispenser.stopping import Run, background, run_until_signal
from dispenser.worker_segments import SegmentStart, grants_dir, open_grants
from dispenser.worker_snowflake import SnowflakeStart

__all__ = ["Run", "Worker", "grants_dir", "open_grants", "run_enricher", "run_until_signal", "run_worker"]

log = logging.getLogger(__name__)

_PROBE_CONNECTIONS = 128
"""Open connections to the metrics port at once: probes and scrapers, a handful in practice."""


class Worker(SegmentStart, SnowflakeStart):
    """One dispenser worker: its store, generators, and the NATS and Kafka services that answer requests.

    Args:
        config: the configuration.
        clock: the clock (tests pass a controllable one).
        serve: answer requests over NATS (``nats.enabled``) and Kafka (``kafka.enabled``); false builds
            only the generators (``dispenser enrich``), connecting to NATS just for the snowflake peer
            clock check.
    """

    def __init__(self, config: Config, clock: Clock | None = None, *, serve: bool = True) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.serve = serve
        self.dispatchers: dict[str, Dispatcher] = {}
        self.kafka: KafkaRequestService | None = None
        rate = config.rate
        self.rates = RateBook(
            self.clock,
            RateSettings(
                interval=rate.interval,
                window=rate.window,
                retention=rate.retention,
                peak_sustain=rate.peak_sustain,
                stale_after=rate.stale_after,
                adaptive_step=rate.adaptive_step,
                persist_interval=rate.persist_interval,
            ),
            StepPolicy(
                segment_seconds=rate.segment_seconds, max_step=rate.max_step, hysteresis=rate.hysteresis
            ),
            datacenter=config.nats.datacenter,
        )
        """This worker's consumption rates, its peers', and the adaptive step."""
        # Set by start() as each part comes up (None: that part is off, or not started). What start()
        # opens, it registers on this stack with its clean-up; stop() unwinds it.
        self.rate_publisher: RatePublisher | None = None
        self.rate_listener: KafkaRateListener | None = None
        """The peers' rate events from Kafka, when NATS (which carries them otherwise) is off."""
        self.metrics: HttpServer | None = None
        """``/metrics``, ``/healthz`` and ``/readyz`` on ``metrics.port`` (the HTTP API's server when the
        ports are the same)."""
        self.http: HttpServer | None = None
        """Leaf's HTTP API on ``http.port``, with the operations endpoints beside it."""
        self.started = False
        """True from the end of :meth:`start` to the beginning of :meth:`stop` (``/readyz``)."""
        self.registry: CollectorRegistry | None = None
        """What ``/metrics`` shows (set by :meth:`start`); ``dispenser enrich`` adds the enricher's metrics."""
        self.postgres: PostgresSegmentStore | None = None
        """The PostgreSQL pool: the segment store's, or one opened for the replay store only."""
        self.replay_store: ReplayStore | None = None
        self.grants: GrantFile | None = None
        """The segment grants this worker remembers (``segment.remember_grants``)."""
        self.allocator: SegmentAllocator | None = None
        self.nc: Connection | None = None
        self.service: NatsIdService | None = None
        self.snowflake: SnowflakeGenerator | None = None
        self.registration: SnowflakeRegistration | None = None
        self.identity_guard: IdentityGuard | None = None
        self.residue_guard: ResidueGuard | None = None
        """The guard against another database serving a tag in an intersecting class (segments with NATS)."""
        """The guard against a live peer on this worker's snowflake ID (with NATS)."""
        self._snowflake_left = False
        self._stack = contextlib.AsyncExitStack()
        self.phase = "starting"
        """What the start is doing (said if a signal interrupts it)."""

    @property
    def store(self) -> SegmentStore | None:
        """The segment store (the PostgreSQL pool), if segments are on."""
        return self.postgres if self.config.segment.enabled else None

    async def start(self) -> None:
        """Connect to everything and start serving; on failure, release what was opened and re-raise.

        Every step registers its own clean-up as soon as it has something to release, so a start that
        fails half-way releases exactly what it opened (see :meth:`stop`).

        Raises:
            OSError: NATS cannot be reached, or Kafka refuses the security settings (``KafkaSecurityError``).
            DispenserError: PostgreSQL or the worker-ID registry cannot be reached, or the clock or
                layout is refused (see :meth:`_start_snowflake`).
        """
        try:
            await self._start(self._stack)
            self.phase = "serving"
            self.started = True
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                log.warning("start interrupted while %s", self.phase)
            try:
                await self.stop()
            except Exception:  # the start's own error is the one to report; this one is logged
                log.exception("could not release everything after a failed start")
            raise

    async def stop(self) -> None:
        """Stop taking requests, answer those in flight, close every connection.

        The clean-ups run in the reverse order of the start (Kafka and NATS services first, the PostgreSQL
        pool last), every one of them even if an earlier one raises; the last failure is raised at the end
        (with the earlier ones as its context). A second call does nothing.
        """
        self.started = False  # /readyz: not ready from here on (a load balancer stops sending requests)
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        await stack.aclose()

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        config = self.config
        limits = Limits(
            max_ids=config.limits.max_ids,
            max_ranges=config.limits.max_ranges,
            max_body_bytes=config.limits.max_body_bytes,
            deadline=config.segment.fetch_deadline,
        )
        dispatchers: dict[str, Dispatcher] = {}
        if config.segment.enabled:
            self.phase = "connecting to PostgreSQL"
            self.allocator = await self._start_segments(stack, await self._postgres(stack))
        self.phase = "opening the replay store"
        self.replay_store = await self._open_replay_store(stack)

        def dispatcher(source: IdSource, kind: Kind, kind_limits: Limits) -> Dispatcher:
            return Dispatcher(
                source,
                self.clock,
                kind_limits,
                config.limits.dedup_ttl,
                kind=kind,
                replay_store=self.replay_store,
                refuse_unsettled=config.limits.dedup_unsettled == "refuse",
            )

        if self.allocator is not None:
            dispatchers["segment"] = dispatcher(self.allocator, "segment", limits)
        if config.nats.enabled and (self.serve or config.snowflake.enabled):
            self.phase = f"connecting to NATS at {redact(config.nats.url)}"
            self.nc = nc = await connect(config.nats, on_retry=_first_nats_failure(config))
            stack.push_async_callback(drain, nc)
            log.info("connected to NATS at %s", redact(config.nats.url))
            if self.allocator is not None:
                self.phase = "checking the tags' residue classes against the other databases' workers"
                await self._start_residues(stack, self.allocator, nc)
        special = {}
        if config.snowflake.enabled:
            self.phase = f"registering the snowflake worker ID ({config.snowflake.mode} mode)"
            self.snowflake = await self._start_snowflake(stack)
            snowflake_limits = dataclasses.replace(limits, deadline=config.snowflake.wait_deadline)
            dispatchers["snowflake"] = dispatcher(self.snowflake, "snowflake", snowflake_limits)
            # The same body limit as an ID request's (decode_handler's own default is only a default).
            decode = decode_handler(self.snowflake.layout, config.limits.max_body_bytes)
            special["snowflake"] = {DECODE_TAG: decode}
        self.dispatchers = dispatchers
        if config.kafka.enabled and (self.serve or config.rate.enabled):
            # Once, before the first Kafka client (rate events, requests): a refused password or CA is one
            # clear line here, where aiokafka itself would only say "Unable to bootstrap".
            self.phase = f"connecting to Kafka at {config.kafka.bootstrap_servers}"
            await check_security(config.kafka)
        if config.rate.enabled:
            await self._start_rates(stack)
        operations = self._operations()
        if config.metrics.port is not None and not self._metrics_on_http_port():
            await self._start_metrics(stack, config.metrics.port, operations)
        if not self.serve:
            return
        if self.nc is not None:
            await self._start_nats_service(stack, self.nc, special)
        if config.kafka.enabled:
            await self._start_kafka_service(stack)
        if config.http.port is not None:
            await self._start_http(stack, operations)
        if self.nc is None and self.kafka is None and self.http is None:
            log.warning(
                "neither NATS (nats.enabled), Kafka (kafka.enabled) nor HTTP (http.port) is on: nothing to serve"
            )

    async def _start_metrics(
        self, stack: contextlib.AsyncExitStack, port: int, operations: Operations
    ) -> None:
        """``/metrics``, ``/healthz`` and ``/readyz`` on a port of their own (``metrics.port``)."""
        # A small cap of its own: the probes' port never shares the fate of the API's sockets.
        self.metrics = HttpServer(
            self.config.metrics.host, port, operations, max_connections=_PROBE_CONNECTIONS
        )
        stack.push_async_callback(self.metrics.stop)
        await self.metrics.start()
        log.info("serving Prometheus metrics on %s/metrics (and /healthz, /readyz)", self.metrics.url)

    async def _start_nats_service(
        self,
        stack: contextlib.AsyncExitStack,
        nc: Connection,
        special: Mapping[str, Mapping[str, SpecialHandler]],
    ) -> None:
        """Answer the ID requests on NATS, in the queue group (not the snowflake one if refused)."""
        config = self.config
        self.service = NatsIdService(nc, config.nats, self.dispatchers, special_tags=special)
        if self._snowflake_left:
            self.service.leave("snowflake")
        stack.push_async_callback(self.service.stop)
        await self.service.start()
        prefix = config.nats.subject_prefix
        log.info(
            "serving %s in queue group %r",
            ", ".join(id_subject(prefix, kind, "<tag>") for kind in self.dispatchers),
            config.nats.queue_group,
        )

    async def _start_kafka_service(self, stack: contextlib.AsyncExitStack) -> None:
        """Answer the ID requests on Kafka's request topic."""
        config = self.config
        self.phase = f"connecting to Kafka at {config.kafka.bootstrap_servers}"
        self.kafka = KafkaRequestService(
            config.kafka,
            self.dispatchers,
            max_body_bytes=config.limits.max_body_bytes,
            request_max_age=config.kafka.request_max_age,
            reply_timeout=config.kafka.reply_timeout,
        )
        # Registered before start(): stop() also closes the clients of a start that failed half-way.
        stack.push_async_callback(self.kafka.stop)
        await self.kafka.start()

    def _metrics_on_http_port(self) -> bool:
        """Whether ``metrics.port`` is ``http.port``: then the HTTP API's server serves ``/metrics`` too."""
        config = self.config
        port = config.metrics.port
        return bool(self.serve and port and port == config.http.port)

    def _operations(self) -> Operations:
        """What ``/metrics``, ``/healthz`` and ``/readyz`` read of this worker."""
        self.registry = registry = worker_registry(self)
        return Operations(
            metrics=lambda: exposition(registry),
            not_ready=lambda: not_ready(self),
            cannot_issue=lambda: cannot_issue(self),
        )

    async def _start_http(self, stack: contextlib.AsyncExitStack, operations: Operations) -> None:
        """Leaf's HTTP API (docs/http.md), answered by the same dispatchers as NATS and Kafka."""
        config = self.config
        decode = None
        try:  # Leaf decodes with its layout whether or not snowflake is on; so does this, with ours
            layout = self.snowflake.layout if self.snowflake is not None else layout_of(config.snowflake)
            decode = functools.partial(decode_id, layout)
        except DispenserError as exc:  # a broken layout of a generator that is off: no decode, no exit
            log.warning("no /decodeSnowflakeId: %s", exc)
        leaf = LeafApi(self.dispatchers, decode=decode)
        http = config.http
        assert http.port is not None
        access = HttpAccess.from_config(http)
        if not self._metrics_on_http_port():  # /metrics names every tag and its volume: not to every caller
            operations = dataclasses.replace(operations, metrics=None)
        self.http = HttpServer(
            http.host,
            http.port,
            operations,
            leaf,
            access=access,
            max_connections=http.max_connections,
            open_files=raise_open_files_limit(),
            keepalive_timeout=http.keepalive_timeout,
            head_timeout=http.head_timeout,
        )
        if self.http.max_connections < http.max_connections:
            log.warning(
                "http.max_connections lowered from %d to %d to fit the open files limit (ulimit -n) with %d to spare",
                http.max_connections,
                self.http.max_connections,
                FD_RESERVE,
            )
        stack.push_async_callback(self.http.stop)
        await self.http.start()
        if self._metrics_on_http_port():
            self.metrics = self.http
        log.info(
            "serving Leaf's HTTP API on %s (%s; %s)",
            self.http.url,
            ", ".join(f"/api/{kind}/get/<key>" for kind in self.dispatchers) or "no generator",
            f"callers: {', '.join(access.names())}" if not access.open else "open to anyone who reaches it",
        )

    async def _start_rates(self, stack: contextlib.AsyncExitStack) -> None:
        """Publish this worker's rate events (NATS; Kafka too when on), hear its peers' (NATS, or else Kafka)."""
        config = self.config
        sinks: list[EventSink] = []
        if self.nc is not None:
            # The subscription ends with the connection's drain.
            await subscribe_rates(self.nc, config.nats.subject_prefix, self.rates.observe)
            sinks.append(rate_sink(self.nc, config.nats.subject_prefix))
        if config.kafka.enabled:
            sink = KafkaRateSink(config.kafka, config.rate.kafka_topic)
            await sink.start()
            stack.push_async_callback(sink.close)
            sinks.append(sink)
            if self.nc is None:  # Kafka-only: hear the peers there (with NATS, its subscription does)
                listener = KafkaRateListener(config.kafka, config.rate.kafka_topic, self.rates.observe)
                await listener.start()
                stack.push_async_callback(listener.close)
                self.rate_listener = listener
        self.rate_publisher = RatePublisher(self.rates, self.allocator, sinks, peak_store=self.store)
        background(stack, self.rate_publisher.run(), "rate-events")


def _first_nats_failure(config: Config) -> Callable[[Exception], None]:
    """Say once why NATS cannot be reached yet, and for how long the start keeps trying."""
    said = False

    def on_retry(exc: Exception) -> None:
        nonlocal said
        if not said:
            said = True
            log.warning(
                "cannot reach NATS at %s yet (%s): trying again for up to %g s (nats.start_deadline)",
                redact(config.nats.url),
                exc or type(exc).__name__,
                config.nats.start_deadline,
            )
        else:
            log.debug("NATS not reachable yet: %s", exc)

    return on_retry


async def run_worker(config: Config, on_ready: Callable[[Worker], None] | None = None) -> int:
    """Run a worker until SIGTERM or SIGINT; returns the exit status."""

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        worker = Worker(config)
        await worker.start()  # releases what it opened if it fails
        stack.push_async_callback(worker.stop)
        if on_ready is not None:
            on_ready(worker)

        async def serve(stop: asyncio.Event) -> None:
            await stop.wait()
            log.info("shutting down: answering requests in flight")
            await worker.stop()
            log.info("stopped")

        return serve

    return await run_until_signal(start)


async def run_enricher(config: Config, settings: EnrichSettings) -> int:
    """Run ``dispenser enrich`` until SIGTERM or SIGINT; returns the exit status.

    Only the generator the stream uses is started (``settings.kind``), without serving requests.
    """
    segment = settings.kind == "segment"
    config = msgspec.structs.replace(
        config,
        segment=msgspec.structs.replace(config.segment, enabled=segment),
        snowflake=msgspec.structs.replace(config.snowflake, enabled=not segment),
        # Kafka is there by definition: the rate events go to its topic (requests are not served).
        kafka=msgspec.structs.replace(config.kafka, enabled=True),
    )

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        worker = Worker(config, serve=False)
        await worker.start()
        stack.push_async_callback(worker.stop)
        source: IdSource
        if worker.allocator is not None:
            await worker.allocator.resolve(settings.tag)  # an unknown tag is a start-up error
            source = worker.allocator
        elif worker.snowflake is not None:
            source = worker.snowflake
        else:  # not reachable: the config above turns exactly one generator on
            raise DispenserError(f"no {settings.kind} generator started")
        enricher = Enricher(config.kafka, settings, source)
        if worker.registry is not None:
            worker.registry.register(EnricherCollector(enricher, settings.input_topic))
        stack.push_async_callback(enricher.close)  # the enricher is closed before the worker stops
        await enricher.start()

        async def enrich(stop: asyncio.Event) -> None:
            await enricher.run(stop)
            stats = enricher.stats
            log.info(
                "stopped: %d records enriched, %d dead-lettered, %d transactions",
                stats.enriched,
                stats.dead_lettered,
                stats.transactions,
            )

        return enrich

    return await run_until_signal(start)
