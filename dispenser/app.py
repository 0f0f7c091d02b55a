"""Wiring: builds the running worker from a :class:`Config`, and runs it until a signal arrives."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from dispenser.adapters.http import HttpServer, LeafApi, Operations
from dispenser.adapters.http.access import HttpAccess
from dispenser.adapters.http.guard import FD_RESERVE, raise_open_files_limit
from dispenser.adapters.kafka.clients import KafkaRateSink, check_security
from dispenser.adapters.kafka.enrich import Enricher, EnrichSettings
from dispenser.adapters.kafka.rates import KafkaRateListener
from dispenser.adapters.kafka.requests import KafkaRequestService
from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.local.statefile import default_state_dir
from dispenser.adapters.nats.client import Connection
from dispenser.adapters.nats.connection import connect, drain
from dispenser.adapters.nats.peers import collect_peer_clocks, join_peers
from dispenser.adapters.nats.rates import rate_sink, subscribe_rates
from dispenser.adapters.nats.residues import announce, ask_residues, message_of, serve_residues
from dispenser.adapters.nats.service import NatsIdService
from dispenser.adapters.postgres.database import database_of
from dispenser.adapters.postgres.replay import PostgresReplayStore
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.adapters.prometheus import EnricherCollector, exposition, worker_registry
from dispenser.config import Config
from dispenser.core.errors import DispenserError, PeerClockUnverified, StateDirUnusable, WorkerIdInUse
from dispenser.core.peers import check_peer_clocks
from dispenser.core.residue_claims import Database, ResidueClaim
from dispenser.core.step import StepPolicy
from dispenser.messages import (
    DECODE_TAG,
    Kind,
    clock_subject,
    id_subject,
    residue_check_subject,
    residue_subject,
)
from dispenser.ports import Clock, IdSource, ReplayStore, SegmentStore, SystemClock
from dispenser.readiness import cannot_issue, not_ready
from dispenser.redaction import redact
from dispenser.registries import SnowflakeRegistration, layout_of, open_registration
from dispenser.service.decode import decode_handler, decode_id
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.identity import IdentityGuard
from dispenser.service.rates import EventSink, RateBook, RatePublisher, RateSettings
from dispenser.service.residues import ResidueGuard
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings

__all__ = ["Run", "Worker", "grants_dir", "open_grants", "run_enricher", "run_until_signal", "run_worker"]

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PROBE_CONNECTIONS = 128
"""Open connections to the metrics port at once: probes and scrapers, a handful in practice."""


class Worker:
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
            # A small cap of its own: the probes' port never shares the fate of the API's sockets.
            self.metrics = HttpServer(
                config.metrics.host, config.metrics.port, operations, max_connections=_PROBE_CONNECTIONS
            )
            stack.push_async_callback(self.metrics.stop)
            await self.metrics.start()
            log.info("serving Prometheus metrics on %s/metrics (and /healthz, /readyz)", self.metrics.url)
        if not self.serve:
            return
        if self.nc is not None:
            self.service = NatsIdService(self.nc, config.nats, dispatchers, special_tags=special)
            if self._snowflake_left:
                self.service.leave("snowflake")
            stack.push_async_callback(self.service.stop)
            await self.service.start()
            prefix = config.nats.subject_prefix
            log.info(
                "serving %s in queue group %r",
                ", ".join(id_subject(prefix, kind, "<tag>") for kind in dispatchers),
                config.nats.queue_group,
            )
        if config.kafka.enabled:
            self.phase = f"connecting to Kafka at {config.kafka.bootstrap_servers}"
            self.kafka = KafkaRequestService(
                config.kafka,
                dispatchers,
                max_body_bytes=config.limits.max_body_bytes,
                request_max_age=config.kafka.request_max_age,
                reply_timeout=config.kafka.reply_timeout,
            )
            # Registered before start(): stop() also closes the clients of a start that failed half-way.
            stack.push_async_callback(self.kafka.stop)
            await self.kafka.start()
        if config.http.port is not None:
            await self._start_http(stack, operations)
        if self.nc is None and self.kafka is None and self.http is None:
            log.warning(
                "neither NATS (nats.enabled), Kafka (kafka.enabled) nor HTTP (http.port) is on: nothing to serve"
            )

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

    async def _postgres(self, stack: contextlib.AsyncExitStack) -> PostgresSegmentStore:
        """The PostgreSQL pool, opened on first need (segments, the replay store) and closed last.

        With ``segment.remember_grants``, the pool remembers every grant in the state directory and repairs
        a new primary that lost some (docs/ha.md).
        """
        if self.postgres is None:
            pg = self.config.postgres
            grants = await open_grants(self.config)
            if grants is not None:
                stack.callback(grants.close)
                self.grants = grants
            self.postgres = await PostgresSegmentStore.connect(
                pg.dsn,
                min_size=pg.pool_min,
                max_size=pg.pool_max,
                command_timeout=pg.command_timeout,
                connect_timeout=pg.connect_timeout,
                grants=grants,
                new_primary_grace=pg.new_primary_grace if grants is not None else 0.0,
                # A serving worker starts without PostgreSQL (no primary yet, a failover, a DSN naming
                # only standbys) and answers `unavailable` until it can reach it: one line, not an exit.
                lazy=self.serve,
            )
            stack.push_async_callback(self.postgres.close)
            if self.postgres.start_error is not None:
                log.warning(
                    "PostgreSQL cannot be reached yet, serving anyway: segment requests are answered "
                    "'unavailable' (retryable) until it can (%s)",
                    self.postgres.start_error,  # str(): where PostgreSQL is, for the operator
                )
            else:
                log.info("connected to PostgreSQL at %s", redact(pg.dsn))
        return self.postgres

    async def _start_segments(
        self, stack: contextlib.AsyncExitStack, store: PostgresSegmentStore
    ) -> SegmentAllocator:
        """The segment allocator, its tag list loaded if PostgreSQL answers, and its refresh loop."""
        config = self.config
        if store.connected:  # else said once already (see _postgres); the allocator retries by itself
            await self._restore_peaks(store)
        allocator = SegmentAllocator(
            store,
            self.clock,
            AllocatorSettings(
                prefetch_threshold=config.segment.prefetch_threshold,
                refresh_interval=config.segment.refresh_interval,
                retry_max=config.segment.retry_max,
            ),
            sizer=self.rates.size,
            meters=self.rates.segment_meter,
        )
        stack.push_async_callback(allocator.close)
        try:
            if store.connected:
                await allocator.refresh()
                log.info("serving %d segment tags", len(allocator.tags))
        except DispenserError as exc:
            log.warning("could not load the tag list yet (will retry): %s", exc)
        _background(stack, allocator.run_refresh_loop(), "segment-refresh")
        return allocator

    async def _open_replay_store(self, stack: contextlib.AsyncExitStack) -> ReplayStore | None:
        """The fleet-wide store of answers to requests with a ``request_id`` (``limits.dedup_store``)."""
        config = self.config
        choice = config.limits.dedup_store
        if choice == "auto":
            uses_postgres = config.segment.enabled or (
                config.snowflake.enabled and config.snowflake.mode == "postgres"
            )
            choice = "postgres" if uses_postgres else "local"
        if choice == "local":
            if config.snowflake.enabled:
                log.info(
                    "request_id answers are kept by this worker only (limits.dedup_store = 'local'): a retry "
                    "that reaches another worker gets new IDs; set it to 'postgres' for fleet-wide retries"
                )
            return None
        store = PostgresReplayStore(await self._postgres(stack))
        _background(stack, self._sweep_replays(store), "replay-sweep")
        return store

    async def _sweep_replays(self, store: PostgresReplayStore) -> None:
        """Delete expired answers every TTL (any worker may; the delete is idempotent)."""
        interval = max(self.config.limits.dedup_ttl, 1.0)
        while True:
            await asyncio.sleep(interval)
            try:
                swept = await store.sweep()
            except DispenserError as exc:
                log.debug("could not sweep expired request answers (will retry): %s", exc)
                continue
            if swept:
                log.debug("swept %d expired request answers", swept)

    async def _restore_peaks(self, store: PostgresSegmentStore) -> None:
        """Start from the saved fleet peaks (a restart at peak time, of any number of workers, sizes from them)."""
        try:
            peaks = await store.load_peaks("segment")
        except DispenserError as exc:
            log.warning("could not load the saved rate peaks (sizing from scratch): %s", exc)
            return
        self.rates.restore("segment", peaks)
        if peaks:
            log.info("restored the rate peaks of %d tag(s)", len(peaks))

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
        _background(stack, self.rate_publisher.run(), "rate-events")

    async def _start_residues(
        self, stack: contextlib.AsyncExitStack, allocator: SegmentAllocator, nc: Connection
    ) -> None:
        """Claim each tag's class at its first segment, against the other databases' (docs/datacenters.md)."""
        config = self.config
        prefix = config.nats.subject_prefix
        subject, check_subject = residue_subject(prefix), residue_check_subject(prefix)
        store = self.postgres
        assert store is not None

        async def database() -> Database:
            return await database_of(store)

        async def announce_claims(claims: list[ResidueClaim]) -> None:
            await announce(nc, subject, guard, claims)

        guard = ResidueGuard(
            self.rates.worker,
            database,
            announce_claims,
            datacenter=config.nats.datacenter,
            on_refuse=allocator.refuse,
        )
        self.residue_guard = guard
        if store.connected:
            with contextlib.suppress(DispenserError):  # else read at the first segment
                await guard.read_database()
        # Announcements first, so that none made from here on is missed; then ask, before answering checks
        # ourselves: with no other worker listening, the server's "no responders" ends the wait at once.
        await serve_residues(nc, subject, None, guard)
        window = config.segment.residue_check_window
        heard = await ask_residues(nc, check_subject, window, message_of(guard, []))
        if not heard.answered:
            log.warning(
                "the residue check on %r got no answer at all, not even the server's 'no responders': no "
                "permission to publish there (or to receive on _INBOX.>), or the server is slow; the tags' "
                "classes are checked only against the claims announced from now on (docs/datacenters.md)",
                check_subject,
            )
        await guard.heard(heard.claims)
        await serve_residues(nc, None, check_subject, guard)
        allocator.check_residues(guard)
        _background(stack, self._recheck_residues(guard, nc, check_subject), "residue-checks")

    async def _recheck_residues(self, guard: ResidueGuard, nc: Connection, subject: str) -> None:
        """Check the claims again now and then: a worker that missed an announcement hears it here."""
        segment = self.config.segment
        while True:
            await asyncio.sleep(segment.residue_recheck_interval)
            round_ = guard.begin_round()
            try:
                heard = await ask_residues(
                    nc, subject, segment.residue_check_window, message_of(guard, guard.claims())
                )
            except Exception as exc:  # NATS down or slow: the next round tries again
                log.debug("could not check the residue classes (will retry): %r", exc)
                continue
            await guard.end_round(round_, heard.claims)

    async def _start_snowflake(self, stack: contextlib.AsyncExitStack) -> SnowflakeGenerator:
        """Register the worker ID, check the clock against the record and the peers, start the generator."""
        config = self.config
        sf = config.snowflake
        self.registration = registration = await open_registration(sf, config.postgres, self.clock)
        stack.push_async_callback(registration.close)
        lease = registration.lease
        clock_check = clock_subject(config.nats.subject_prefix)
        guard = IdentityGuard(
            sf.datacenter_id,
            lambda: self.snowflake.worker_id if self.snowflake is not None else lease.worker_id,
            registration.address,
            layout=registration.layout,
        )
        if self.nc is not None:
            self.identity_guard = guard
            # Answer (and hear the peers' claims) before asking, and ask again a window later: of two workers
            # starting at once, at most one serves (docs/snowflake.md, "Two workers on one ID").
            _, heard = await join_peers(
                self.nc, clock_check, self.clock.wall_ms, sf.peer_check_timeout, guard
            )
            readings = heard.readings
            if not heard.answered:
                detail = (
                    f"the peer clock check on {clock_check!r} got no answer at all, not even the server's "
                    "'no responders': no permission to publish there (or to receive on _INBOX.>), or the "
                    "server is slow; the clock is NOT checked against the peers (see docs/security.md)"
                )
                if sf.peer_check_failure == "refuse":
                    raise PeerClockUnverified(detail)
                log.warning("%s", detail)
            offset = check_peer_clocks(readings, sf.peer_threshold_ms)
            if offset is not None:
                log.info("clock is within %.0f ms of the mean of %d live peer(s)", offset, len(readings))
            elif heard.answered:
                log.info("no live snowflake peers answered the clock check: this worker is the first")
        else:
            log.warning("NATS is off: the snowflake clock and worker ID are not checked against live peers")
        settings = SnowflakeSettings(
            random_start=sf.random_start,
            max_backward_ms=sf.max_backward_ms,
            report_interval=sf.report_interval,
            registry_outage=registration.registry_outage,
        )
        generator = SnowflakeGenerator(
            registration.layout,
            lease,
            registration,  # the registry, except that a start from the local cache may issue at once
            self.clock,
            registration.persist,
            settings=settings,
            persist_clean_stop=registration.persist_clean_stop,
            datacenter_id=sf.datacenter_id,
        )

        def refuse(error: WorkerIdInUse) -> None:
            generator.refuse(error)
            self._leave_snowflake()

        guard.on_refuse = refuse
        if guard.refusal is not None:
            refuse(guard.refusal)
        await generator.start()
        stack.push_async_callback(generator.stop)
        generator.on_issue = self._snowflake_meter
        if registration.from_cache:
            generator.relocate(pause=False)  # keep trying the registry; the cached ID stays ours
        if self.nc is not None:
            _background(stack, self._recheck_peers(guard, clock_check), "snowflake-peers")
        where = f"datacenter {sf.datacenter_id}, " if registration.layout.datacenter_bits else ""
        log.info(
            "snowflake worker ID %d (%s%s mode); layout valid until %s",
            generator.worker_id,
            where,
            sf.mode,
            registration.layout.end_datetime().isoformat(),
        )
        return generator

    def _leave_snowflake(self) -> None:
        """A refused worker leaves the snowflake queue group (or never joins it).

        With NATS gateways, a datacenter's callers are then served by another datacenter's workers
        instead of this worker's refusals (docs/datacenters.md). Kafka requests still get the refusal.
        """
        self._snowflake_left = True
        if self.service is not None:
            self.service.leave("snowflake")

    async def _recheck_peers(self, guard: IdentityGuard, subject: str) -> None:
        """Ask the live peers again now and then: two workers that started unheard by each other meet here."""
        sf = self.config.snowflake
        assert self.nc is not None
        while guard.refusal is None:
            await asyncio.sleep(sf.peer_recheck_interval)
            try:
                heard = await collect_peer_clocks(
                    self.nc, subject, self.clock.wall_ms, sf.peer_check_timeout, claim=guard.claim()
                )
            except Exception as exc:  # NATS down or slow: the next round tries again
                log.debug("could not check the snowflake peers (will retry): %r", exc)
                continue
            guard.heard(heard.claims)

    def _snowflake_meter(self, tag: str, count: int) -> None:
        # Snowflake serves any tag name: the book keeps a bounded table of meters in which invented names
        # give way to each other first, and every tag served gets one (issue 33, item 6).
        self.rates.record("snowflake", tag, count)


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


def _background(stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    """Run ``work`` in a task of its own, cancelled (and awaited) on stop."""
    task = asyncio.create_task(work, name=name)
    stack.push_async_callback(_cancel, task)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


_STOP_BUDGET = 8.0
"""Seconds a command has, from SIGTERM or SIGINT, to wind down (a stop that hangs on a silent dependency is
cut short there): within the 10 s every process must stop in, Kubernetes' grace period of 30 s included."""


@contextlib.contextmanager
def _stop_on_signal(on_signal: Callable[[], None]) -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT while the block runs, which also calls ``on_signal`` (removed after)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        stop.set()
        on_signal()

    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, signalled)
    try:
        yield stop
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


Run = Callable[[asyncio.Event], Awaitable[None]]
"""The work of a command once started: runs until the stop event is set (then winds down, and returns)."""


async def run_until_signal(
    start: Callable[[contextlib.AsyncExitStack], Awaitable[Run]], *, stop_budget: float = _STOP_BUDGET
) -> int:
    """Start a command, run it until SIGTERM or SIGINT, release what it opened; returns the exit status.

    A signal stops the command in every state: while it starts (a dependency still being waited for: the
    start is cancelled, what it opened released, exit status 1) and while it runs. From the first signal,
    the wind-down has ``stop_budget`` seconds; past them (a dependency that hangs on close), or at a
    second signal, it is cut short, said in one line, and the exit status is 1.

    Args:
        start: opens what the command needs, registering each clean-up on the stack it is given (they run
            in reverse order when the command ends, however it ends), and returns the command's work.
            An ``OSError`` or :class:`DispenserError` from it is a start-up failure: logged in one line,
            exit status 1.
        stop_budget: seconds from the signal to the end of the wind-down.
    """
    loop = asyncio.get_running_loop()
    budget = asyncio.timeout(None)

    def signalled() -> None:
        # The first signal starts the budget; a second one (an impatient Ctrl-C) ends it now.
        when = loop.time() + stop_budget if budget.when() is None else loop.time()
        budget.reschedule(when)

    try:
        async with budget:
            with _stop_on_signal(signalled) as stop:
                async with contextlib.AsyncExitStack() as stack:
                    starting = asyncio.ensure_future(start(stack))
                    signal_came = asyncio.ensure_future(stop.wait())
                    try:
                        await asyncio.wait({starting, signal_came}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        signal_came.cancel()
                    if not starting.done():
                        starting.cancel()  # releases what it opened (see Worker.start)
                        await asyncio.gather(starting, return_exceptions=True)
                        log.warning("stopped by a signal before the start finished")
                        return 1
                    try:
                        run = starting.result()
                    except (OSError, DispenserError) as exc:
                        log.error("cannot start: %s", exc)  # the stack releases what was opened
                        return 1
                    await run(stop)
                return 0
    except TimeoutError:
        if not budget.expired():
            raise
    log.error(
        "did not stop within %g s of the signal: gave up waiting for the rest of the clean-up", stop_budget
    )
    return 1


def grants_dir(config: Config) -> Path:
    """The directory ``segment.remember_grants`` keeps its files in (``segment.state_dir``, else snowflake's)."""
    configured = config.segment.state_dir or config.snowflake.state_dir
    return Path(configured) if configured else default_state_dir()


async def open_grants(config: Config) -> GrantFile | None:
    """Where this worker remembers its segment grants, or None (``segment.remember_grants`` off).

    Raises:
        StateDirUnusable: the state directory cannot be written, or did not answer within
            ``grants.WRITE_TIMEOUT`` (remembering in memory only would leave a restart unable to repair a
            primary that lost grants, and nobody would know).
    """
    segment = config.segment
    if not (segment.enabled and segment.remember_grants):
        return None
    directory = grants_dir(config)
    try:
        return await GrantFile.open_within(directory)
    except OSError as exc:
        raise StateDirUnusable(str(directory), exc.strerror or str(exc)) from exc


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
