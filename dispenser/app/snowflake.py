"""A worker's snowflake side: its worker ID registered, its clock checked, its peers heard.

The clock is checked against the record and the live peers (with NATS), which are asked again while it
serves; a refused worker leaves the snowflake queue group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from dispenser.adapters.nats.connection import Connection
from dispenser.adapters.nats.peers import collect_peer_clocks, join_peers
from dispenser.app.parts import Off, settings_of
from dispenser.app.stopping import background
from dispenser.config import Config
from dispenser.core.errors import PeerClockUnverified, WorkerIdInUse
from dispenser.core.peers import check_peer_clocks, mean_offset_ms
from dispenser.messages import clock_subject
from dispenser.ports import Clock
from dispenser.registries import SnowflakeRegistration, open_registration
from dispenser.service.identity import IdentityGuard
from dispenser.service.rates import RateBook
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings
from dispenser.status import ClockCheck

__all__ = ["Snowflake", "start_snowflake"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


class Snowflake:
    """The snowflake generator of a started worker, its registration and the guard of its worker ID."""

    def __init__(
        self,
        generator: SnowflakeGenerator,
        registration: SnowflakeRegistration,
        guard: IdentityGuard,
        clock_check: ClockCheck | None = None,
    ) -> None:
        self.generator = generator
        self.clock_check = clock_check if clock_check is not None else ClockCheck()
        """What the last clock check against the live peers found (the status page shows it)."""
        self.registration = registration
        self.guard = guard
        """The guard against a live peer on this worker's ID (it hears the peers with NATS only)."""
        self.left = False
        """Whether a refusal made this worker leave the snowflake queue group (or never join it)."""
        self._on_leave: list[Callable[[], None]] = []

    def on_leave(self, leave: Callable[[], None]) -> None:
        """Call ``leave`` at every refusal from now on, and now if the worker was refused already.

        With NATS gateways, a datacenter's callers are then served by another datacenter's workers
        instead of this worker's refusals (docs/datacenters.md). Kafka requests still get the refusal.
        """
        self._on_leave.append(leave)
        if self.left:
            leave()

    def refuse(self, error: WorkerIdInUse) -> None:
        """Another live worker claims this ID: issue nothing, leave the queue group."""
        self.generator.refuse(error)
        self.left = True
        for leave in self._on_leave:
            leave()


async def start_snowflake(
    stack: contextlib.AsyncExitStack, config: Config, clock: Clock, rates: RateBook, nc: Connection | Off
) -> Snowflake:
    """Register the worker ID, check the clock against the record and the peers, start the generator."""
    sf = config.snowflake
    registration = await open_registration(sf, config.postgres, clock)
    stack.push_async_callback(registration.close)
    lease = registration.lease
    started: list[SnowflakeGenerator] = []  # the generator, once started (the guard claims its ID)
    guard = IdentityGuard(
        sf.datacenter_id,
        lambda: started[0].worker_id if started else lease.worker_id,
        registration.address,
        layout=registration.layout,
    )
    clock_check = clock_subject(config.nats.subject_prefix)
    checked = ClockCheck()
    if isinstance(nc, Off):
        log.warning("NATS is off: the snowflake clock and worker ID are not checked against live peers")
    else:
        await _check_peers(config, clock, nc, guard, clock_check, checked=checked)
    generator = SnowflakeGenerator(
        registration.layout,
        lease,
        registration,  # the registry, except that a start from the local cache may issue at once
        clock,
        registration.persist,
        settings=settings_of(SnowflakeSettings, sf, registry_outage=registration.registry_outage),
        persist_clean_stop=registration.persist_clean_stop,
        datacenter_id=sf.datacenter_id,
    )
    snowflake = Snowflake(generator, registration, guard, checked)
    guard.on_refuse = snowflake.refuse
    if guard.refusal is not None:
        snowflake.refuse(guard.refusal)
    await generator.start()
    stack.push_async_callback(generator.stop)

    # Snowflake serves any tag name: the book keeps a bounded table of meters in which invented names
    # give way to each other first, and every tag served gets one (issue 33, item 6).
    generator.on_issue = rates.record_snowflake
    if registration.from_cache:
        generator.relocate(pause=False)  # keep trying the registry; the cached ID stays ours
    if not isinstance(nc, Off):
        background(
            stack, _recheck_peers(config, clock, nc, guard, clock_check, checked=checked), "snowflake-peers"
        )
    where = f"datacenter {sf.datacenter_id}, " if registration.layout.datacenter_bits else ""
    log.info(
        "snowflake worker ID %d (%s%s mode); layout valid until %s",
        generator.worker_id,
        where,
        sf.mode,
        registration.layout.end_datetime().isoformat(),
    )
    started.append(generator)
    return snowflake


async def _check_peers(
    config: Config,
    clock: Clock,
    nc: Connection,
    guard: IdentityGuard,
    clock_check: str,
    *,
    checked: ClockCheck,
) -> None:
    """Check the clock against the live peers (what it found into ``checked``), and hear their claims.

    Raises:
        PeerClockUnverified: nothing answered, with ``snowflake.peer_check_failure = "refuse"``.
        ClockDisagreesWithPeers: the clock is too far from the peers'.
    """
    sf = config.snowflake
    # Answer (and hear the peers' claims) before asking, and ask again a window later: of two workers
    # starting at once, at most one serves (docs/snowflake.md, "Two workers on one ID").
    _, heard = await join_peers(nc, clock_check, clock.wall_ms, sf.peer_check_timeout, guard)
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
    checked.record(offset, len(readings), clock.wall_ms())
    if offset is not None:
        log.info("clock is within %.0f ms of the mean of %d live peer(s)", offset, len(readings))
    elif heard.answered:
        log.info("no live snowflake peers answered the clock check: this worker is the first")


async def _recheck_peers(
    config: Config, clock: Clock, nc: Connection, guard: IdentityGuard, subject: str, *, checked: ClockCheck
) -> None:
    """Ask the live peers again now and then: two workers that started unheard by each other meet here."""
    sf = config.snowflake
    while guard.refusal is None:
        await asyncio.sleep(sf.peer_recheck_interval)
        try:
            heard = await collect_peer_clocks(
                nc, subject, clock.wall_ms, sf.peer_check_timeout, claim=guard.claim()
            )
        except Exception as exc:  # NATS down or slow: the next round tries again
            log.debug("could not check the snowflake peers (will retry): %r", exc)
            continue
        guard.heard(heard.claims)
        checked.record(mean_offset_ms(heard.readings), len(heard.readings), clock.wall_ms())
