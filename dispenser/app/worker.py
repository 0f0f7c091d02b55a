"""The worker: its parts started in order into one exit stack, and stopped in the reverse order.

``async with Worker(config) as worker:`` starts every part its configuration turns on and stops them on
exit. Once started, every part exists (:class:`Parts`): its object, or an :class:`~dispenser.app.parts.Off`
naming the setting that leaves it off; the worker's accessors (``worker.allocator``, ``worker.http``, ...)
return the object, and raise :class:`~dispenser.app.parts.PartOff` for a part that is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Self

from prometheus_client import CollectorRegistry

from dispenser.adapters.http import HttpServer
from dispenser.adapters.kafka.connection import check_security
from dispenser.adapters.kafka.rates import KafkaRateListener
from dispenser.adapters.kafka.requests import KafkaRequestService
from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.nats.connection import Connection
from dispenser.adapters.nats.service import NatsIdService, SpecialHandler
from dispenser.adapters.postgres.replay import PostgresReplayStore
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app.http import start_http
from dispenser.app.kafka import start_kafka_service
from dispenser.app.nats import connect_nats, start_nats_service
from dispenser.app.operations import Observed, metrics_on_http_port, operations, start_metrics, status_page
from dispenser.app.ordered import Ordered, start_ordered
from dispenser.app.parts import Off, present, settings_of, unless_off
from dispenser.app.rates import Rates, rate_book, start_rates
from dispenser.app.segments import (
    Postgres,
    Segments,
    open_postgres,
    open_replay_store,
    start_residues,
    start_segments,
)
from dispenser.app.snowflake import Snowflake, start_snowflake
from dispenser.config import Config
from dispenser.messages import DECODE_TAG, Kind
from dispenser.ports import Clock, IdSource, SystemClock
from dispenser.readiness import cannot_issue, not_ready
from dispenser.redaction import redact
from dispenser.registries import SnowflakeRegistration
from dispenser.service.decode import decode_handler
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.identity import IdentityGuard
from dispenser.service.permuted import PermutedMarks, load_permutations
from dispenser.service.residues import ResidueGuard
from dispenser.service.segments import SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator
from dispenser.status import RecentErrors

__all__ = ["NotStarted", "Parts", "ReadinessView", "Worker"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


class NotStarted(RuntimeError):
    """Raised when a worker's parts are asked for before its start has finished."""

    def __init__(self) -> None:
        super().__init__("the worker has not started: `async with Worker(config)`, or `await worker.start()`")


@dataclasses.dataclass(frozen=True, slots=True)
class Parts:
    """What a started worker runs, in start order: each part, or :class:`~dispenser.app.parts.Off`."""

    postgres: Postgres | Off
    """The PostgreSQL pool: the segment store's, or one opened for the replay store only."""
    segments: Segments | Off
    replay_store: PostgresReplayStore | Off
    """The fleet-wide answers to requests with a ``request_id`` (``limits.dedup_store``)."""
    nats: Connection | Off
    residues: ResidueGuard | Off
    """The guard against another database serving a tag in an intersecting class (segments with NATS)."""
    snowflake: Snowflake | Off
    dispatchers: Mapping[str, Dispatcher]
    """By kind (``segment``, ``snowflake``): one per generator that is on."""
    rates: Rates | Off
    registry: CollectorRegistry
    """What ``/metrics`` shows; ``dispenser enrich`` adds the enricher's metrics."""
    metrics: HttpServer | Off
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``metrics.port`` (the HTTP API's server when the ports
    are the same)."""
    service: NatsIdService | Off
    kafka: KafkaRequestService | Off
    http: HttpServer | Off
    """Leaf's HTTP API on ``http.port``, with the operations endpoints beside it."""


class _Sources:
    """What the first half of the start brings up: the generators, the connections they need, the rates."""

    def __init__(self) -> None:
        self.postgres: Postgres | Off = Off("segment.enabled")
        self.segments: Segments | Off = Off("segment.enabled")
        self.replay_store: PostgresReplayStore | Off = Off("limits.dedup_store")
        self.nats: Connection | Off = Off("nats.enabled")
        self.residues: ResidueGuard | Off = Off("segment.enabled, nats.enabled")
        self.snowflake: Snowflake | Off = Off("snowflake.enabled")
        self.rates: Rates | Off = Off("rate.enabled")
        self.dispatchers: dict[str, Dispatcher] = {}
        self.special: dict[str, Mapping[str, SpecialHandler]] = {}


class Worker:
    """One dispenser worker: its store, generators, and the NATS, Kafka and HTTP services that answer requests.

    Args:
        config: the configuration.
        clock: the clock (tests pass a controllable one).
        serve: answer requests over NATS (``nats.enabled``), Kafka (``kafka.enabled``) and HTTP
            (``http.port``); false builds only the generators (``dispenser enrich``), connecting to NATS
            just for the snowflake peer clock check.
    """

    def __init__(self, config: Config, clock: Clock | None = None, *, serve: bool = True) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.serve = serve
        self.rates = rate_book(config, self.clock)
        """This worker's consumption rates, its peers', and the adaptive step."""
        self.started = False
        """True from the end of :meth:`start` to the beginning of :meth:`stop` (``/readyz``)."""
        self.phase = "starting"
        """What the start is doing (said if a signal interrupts it)."""
        self._parts: Parts | None = None  # set by start() at its end: the parts exist from then on
        self.ordered: Ordered | Off = Off("segment.enabled")
        """The ordered tags (docs/ordered.md): their leases and routes on NATS."""
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def probed(self) -> ReadinessView:
        """The worker as ``/readyz`` reads it: a part that is off reads as ``None`` (its accessors here raise)."""
        return ReadinessView(self)

    @property
    def parts(self) -> Parts:
        """Every part, once started (:class:`NotStarted` before); they stay readable after the stop."""
        if self._parts is None:
            raise NotStarted
        return self._parts

    async def start(self) -> None:
        """Connect to everything and start serving; on failure, release what was opened and re-raise.

        Every part registers its own clean-up as soon as it has something to release, so a start that
        fails half-way releases exactly what it opened (see :meth:`stop`).

        Raises:
            OSError: NATS cannot be reached, or Kafka refuses the security settings (``KafkaSecurityError``).
            DispenserError: PostgreSQL or the worker-ID registry cannot be reached, or the clock or
                layout is refused (see :func:`~dispenser.app.snowflake.start_snowflake`).
        """
        try:
            self._parts = await self._start(self._stack)
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

    async def _start(self, stack: contextlib.AsyncExitStack) -> Parts:
        config = self.config
        recent_errors = RecentErrors()  # from the start on: the status page shows the start's warnings too
        recent_errors.attach()
        stack.callback(recent_errors.detach)
        got = await self._start_sources(stack)
        if config.kafka.enabled and (self.serve or config.rate.enabled):
            # Once, before the first Kafka client (rate events, requests): a refused password or CA is one
            # clear line here, where aiokafka itself would only say "Unable to bootstrap".
            self.phase = f"connecting to Kafka at {config.kafka.bootstrap_servers}"
            await check_security(config.kafka)
        if config.rate.enabled:
            got.rates = await start_rates(stack, config, self.rates, got.nats, got.segments)
        segments, snowflake = unless_off(got.segments), unless_off(got.snowflake)
        observed = Observed(
            self.clock,
            self.rates,
            got.dispatchers,
            segments.allocator if segments is not None else None,
            snowflake.generator if snowflake is not None else None,
        )
        probed = self.probed
        ready, issuing = (lambda: not_ready(probed)), (lambda: cannot_issue(probed))
        clock_check = snowflake.clock_check if snowflake is not None else None
        status = status_page(
            config, observed, ready, issuing, clock_check=clock_check, recent_errors=recent_errors
        )
        registry, ops = operations(observed, ready, issuing, status)
        metrics: HttpServer | Off = Off("metrics.port")
        with_metrics = metrics_on_http_port(config, serve=self.serve)
        if config.metrics.port is not None and not with_metrics:
            metrics = await start_metrics(stack, config, config.metrics.port, ops)
        service: NatsIdService | Off = Off("serve" if not self.serve else "nats.enabled")
        kafka: KafkaRequestService | Off = Off("serve" if not self.serve else "kafka.enabled")
        http: HttpServer | Off = Off("serve" if not self.serve else "http.port")
        if self.serve:
            if segments is not None:  # before serving: an ordered tag is never answered on the plain path
                self.phase = "reading the ordered tags"
                await self._start_ordered(stack, got, segments)
            if not isinstance(got.nats, Off):
                service = await start_nats_service(
                    stack, config, got.nats, got.dispatchers, special=got.special, snowflake=got.snowflake
                )
            if config.kafka.enabled:
                self.phase = f"connecting to Kafka at {config.kafka.bootstrap_servers}"
                kafka = await start_kafka_service(stack, config, got.dispatchers, observed.add_kafka)
            if config.http.port is not None:
                http = await start_http(
                    stack,
                    config,
                    config.http.port,
                    got.dispatchers,
                    ops,
                    snowflake=got.snowflake,
                    with_metrics=with_metrics,
                )
                metrics = http if with_metrics else metrics
            if isinstance(got.nats, Off) and isinstance(kafka, Off) and isinstance(http, Off):
                log.warning(
                    "neither NATS (nats.enabled), Kafka (kafka.enabled) nor HTTP (http.port) is on: nothing to serve"
                )
        return Parts(
            postgres=got.postgres,
            segments=got.segments,
            replay_store=got.replay_store,
            nats=got.nats,
            residues=got.residues,
            snowflake=got.snowflake,
            dispatchers=got.dispatchers,
            rates=got.rates,
            registry=registry,
            metrics=metrics,
            service=service,
            kafka=kafka,
            http=http,
        )

    async def _start_sources(self, stack: contextlib.AsyncExitStack) -> _Sources:
        """The generators and what they need: PostgreSQL, the replay store, NATS, the worker ID."""
        config, got = self.config, _Sources()
        limits = settings_of(Limits, config.limits, deadline=config.segment.fetch_deadline)
        # Read first: a malformed key file stops the start rather than serve that tag's counters plain.
        permuted = load_permutations(config.segment.permute_keys_dir) if config.segment.enabled else {}
        marks = PermutedMarks()  # the tags the store marks permuted, from every tag list (docs/permuted.md)
        if config.segment.enabled:
            self.phase = "connecting to PostgreSQL"
            got.postgres = await open_postgres(stack, config, lazy=self.serve)
            got.segments = await start_segments(
                stack, config, self.clock, self.rates, got.postgres.pool, marks=marks
            )
        self.phase = "opening the replay store"
        got.postgres, got.replay_store = await open_replay_store(stack, config, got.postgres, lazy=self.serve)

        def dispatcher(source: IdSource, kind: Kind, kind_limits: Limits) -> Dispatcher:
            return Dispatcher(
                source,
                self.clock,
                kind_limits,
                config.limits.dedup_ttl,
                kind=kind,
                replay_store=unless_off(got.replay_store),
                refuse_unsettled=config.limits.dedup_unsettled == "refuse",
                permuted=permuted if kind == "segment" else None,
                marks=marks if kind == "segment" else None,
            )

        if not isinstance(got.segments, Off):
            got.dispatchers["segment"] = dispatcher(got.segments.allocator, "segment", limits)
        if config.nats.enabled and (self.serve or config.snowflake.enabled):
            self.phase = f"connecting to NATS at {redact(config.nats.url)}"
            got.nats = await connect_nats(stack, config)
            if not isinstance(got.segments, Off):
                self.phase = "checking the tags' residue classes against the other databases' workers"
                got.residues = await start_residues(stack, config, self.rates, got.segments, got.nats)
        if config.snowflake.enabled:
            self.phase = f"registering the snowflake worker ID ({config.snowflake.mode} mode)"
            got.snowflake = snowflake = await start_snowflake(stack, config, self.clock, self.rates, got.nats)
            snowflake_limits = dataclasses.replace(limits, deadline=config.snowflake.wait_deadline)
            got.dispatchers["snowflake"] = dispatcher(snowflake.generator, "snowflake", snowflake_limits)
            # The same body limit as an ID request's (decode_handler's own default is only a default).
            decode = decode_handler(snowflake.generator.layout, config.limits.max_body_bytes)
            got.special["snowflake"] = {DECODE_TAG: decode}
        return got

    async def _start_ordered(
        self, stack: contextlib.AsyncExitStack, got: _Sources, segments: Segments
    ) -> None:
        """The ordered tags (docs/ordered.md): routed on NATS by the ``segment`` endpoint's special tags."""
        config, plain = self.config, got.dispatchers["segment"]

        def answerer(source: IdSource) -> Dispatcher:
            return Dispatcher(
                source,
                self.clock,
                plain.limits,
                config.limits.dedup_ttl,
                kind="segment",
                replay_store=unless_off(got.replay_store),
                refuse_unsettled=plain.refuse_unsettled,
            )

        nc = unless_off(got.nats)
        self.ordered = ordered = await start_ordered(
            stack, config, self.clock, nc, segments, dispatcher=plain, answerer=answerer
        )
        if nc is not None:
            got.special["segment"] = ordered.routes

    # The parts by name: each returns its object, and raises PartOff if the configuration leaves it off.

    @property
    def dispatchers(self) -> Mapping[str, Dispatcher]:
        """The dispatchers by kind, one per generator that is on."""
        return self.parts.dispatchers

    @property
    def registry(self) -> CollectorRegistry:
        """What ``/metrics`` shows."""
        return self.parts.registry

    @property
    def postgres(self) -> PostgresSegmentStore:
        """The PostgreSQL pool: the segment store's, or one opened for the replay store only."""
        return present(self.parts.postgres, "PostgreSQL pool").pool

    @property
    def grants(self) -> GrantFile:
        """The segment grants this worker remembers (``segment.remember_grants``)."""
        return present(present(self.parts.postgres, "PostgreSQL pool").grants, "grants file")

    @property
    def store(self) -> PostgresSegmentStore:
        """The segment store (the PostgreSQL pool)."""
        return present(self.parts.segments, "segment generator").store

    @property
    def allocator(self) -> SegmentAllocator:
        """The segment allocator."""
        return present(self.parts.segments, "segment generator").allocator

    @property
    def replay_store(self) -> PostgresReplayStore:
        """The fleet-wide replay store."""
        return present(self.parts.replay_store, "fleet-wide replay store")

    @property
    def residue_guard(self) -> ResidueGuard:
        """The guard of the tags' residue classes (segments with NATS)."""
        return present(self.parts.residues, "residue check")

    @property
    def nc(self) -> Connection:
        """The NATS connection."""
        return present(self.parts.nats, "NATS connection")

    @property
    def service(self) -> NatsIdService:
        """The ID requests answered on NATS."""
        return present(self.parts.service, "NATS service")

    @property
    def kafka(self) -> KafkaRequestService:
        """The ID requests answered on Kafka."""
        return present(self.parts.kafka, "Kafka request service")

    @property
    def http(self) -> HttpServer:
        """Leaf's HTTP API."""
        return present(self.parts.http, "HTTP API")

    @property
    def metrics(self) -> HttpServer:
        """The server of ``/metrics`` (the HTTP API's, when ``metrics.port`` is ``http.port``)."""
        return present(self.parts.metrics, "metrics port")

    @property
    def snowflake(self) -> SnowflakeGenerator:
        """The snowflake generator."""
        return present(self.parts.snowflake, "snowflake generator").generator

    @property
    def registration(self) -> SnowflakeRegistration:
        """The snowflake worker ID's registration."""
        return present(self.parts.snowflake, "snowflake generator").registration

    @property
    def identity_guard(self) -> IdentityGuard:
        """The guard against a live peer on this worker's snowflake ID."""
        return present(self.parts.snowflake, "snowflake generator").guard

    @property
    def rate_listener(self) -> KafkaRateListener:
        """The peers' rate events from Kafka (when NATS is off)."""
        return present(present(self.parts.rates, "rate events").listener, "Kafka rate listener")


class ReadinessView:
    """The worker as ``/readyz`` reads it (:class:`dispenser.readiness.RunningWorker`): its parts once started.

    A part the configuration leaves off is ``None`` here; pass this, not the :class:`Worker`, to
    :func:`~dispenser.readiness.not_ready` and :func:`~dispenser.readiness.cannot_issue`.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    @property
    def config(self) -> Config:
        """Its configuration."""
        return self._worker.config

    @property
    def started(self) -> bool:
        """Whether it has started and is not stopping."""
        return self._worker.started

    @property
    def serve(self) -> bool:
        """Whether it serves requests."""
        return self._worker.serve

    @property
    def nc(self) -> Connection | None:
        """Its NATS connection, or None when NATS is off."""
        return unless_off(self._worker.parts.nats)

    @property
    def postgres(self) -> PostgresSegmentStore | None:
        """Its PostgreSQL pool, or None without one."""
        postgres = unless_off(self._worker.parts.postgres)
        return postgres.pool if postgres is not None else None

    @property
    def allocator(self) -> SegmentAllocator | None:
        """Its segment allocator, or None when segments are off."""
        segments = unless_off(self._worker.parts.segments)
        return segments.allocator if segments is not None else None

    @property
    def snowflake(self) -> SnowflakeGenerator | None:
        """Its snowflake generator, or None when snowflake is off."""
        snowflake = unless_off(self._worker.parts.snowflake)
        return snowflake.generator if snowflake is not None else None
