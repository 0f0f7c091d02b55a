"""The snowflake side of a worker: its worker ID registered, its clock checked, its peers heard.

The clock is checked against the record and the live peers, which are asked again while it serves; a refused
worker leaves the queue group. :class:`dispenser.app.Worker` mixes it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from dispenser.adapters.nats.connection import Connection
from dispenser.adapters.nats.peers import collect_peer_clocks, join_peers
from dispenser.adapters.nats.service import NatsIdService
from dispenser.config import Config
from dispenser.core.errors import PeerClockUnverified, WorkerIdInUse
from dispenser.core.peers import check_peer_clocks
from dispenser.messages import clock_subject
from dispenser.ports import Clock
from dispenser.registries import SnowflakeRegistration, open_registration
from dispenser.service.identity import IdentityGuard
from dispenser.service.rates import RateBook
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings
from dispenser.stopping import background

__all__ = ["SnowflakeStart"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


class SnowflakeStart:
    """The start-up steps of a worker's snowflake side (the attributes are :class:`dispenser.app.Worker`'s)."""

    config: Config
    clock: Clock
    rates: RateBook
    nc: Connection | None
    service: NatsIdService | None
    snowflake: SnowflakeGenerator | None
    registration: SnowflakeRegistration | None
    identity_guard: IdentityGuard | None
    _snowflake_left: bool

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
            background(stack, self._recheck_peers(guard, clock_check), "snowflake-peers")
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
