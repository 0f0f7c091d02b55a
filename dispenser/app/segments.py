"""A worker's segment side: the PostgreSQL pool, the segment allocator, the replay store, the residue claims.

Also the grants the pool remembers (``segment.remember_grants``). Each ``start``/``open`` function registers
its clean-up on the stack it is given and returns its part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.local.statefile import default_state_dir
from dispenser.adapters.nats.connection import Connection
from dispenser.adapters.nats.residues import announce, ask_residues, message_of, serve_residues
from dispenser.adapters.postgres.database import database_of
from dispenser.adapters.postgres.replay import PostgresReplayStore
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app.parts import Off, settings_of
from dispenser.app.stopping import background
from dispenser.config import Config
from dispenser.core.errors import DispenserError, StateDirUnusable
from dispenser.core.residue_claims import Database, ResidueClaim
from dispenser.messages import residue_check_subject, residue_subject
from dispenser.ports import Clock
from dispenser.redaction import redact
from dispenser.service.permuted import MarkingStore, PermutedMarks
from dispenser.service.rates import RateBook
from dispenser.service.residues import ResidueGuard
from dispenser.service.returns import return_unused
from dispenser.service.segments import AllocatorSettings, SegmentAllocator

__all__ = [
    "Postgres",
    "Segments",
    "grants_dir",
    "open_grants",
    "open_postgres",
    "open_replay_store",
    "start_residues",
    "start_segments",
]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


@dataclass(frozen=True, slots=True)
class Postgres:
    """The PostgreSQL pool (the segment store's, or one opened for the replay store only)."""

    pool: PostgresSegmentStore
    grants: GrantFile | Off
    """The segment grants the pool remembers (``segment.remember_grants``)."""


@dataclass(frozen=True, slots=True)
class Segments:
    """The segment generator: its allocator, over the PostgreSQL pool."""

    allocator: SegmentAllocator
    store: PostgresSegmentStore


async def open_postgres(stack: contextlib.AsyncExitStack, config: Config, *, lazy: bool) -> Postgres:
    """The PostgreSQL pool, closed last (it is opened first).

    With ``segment.remember_grants``, the pool remembers every grant in the state directory and repairs
    a new primary that lost some (docs/ha.md).

    Args:
        stack: where its clean-up goes.
        config: the configuration.
        lazy: start without PostgreSQL (a serving worker: no primary yet, a failover, a DSN naming only
            standbys), answering ``unavailable`` until it can reach it: one line, not an exit.
    """
    pg = config.postgres
    grants = await open_grants(config)
    if grants is not None:
        stack.callback(grants.close)
    pool = await PostgresSegmentStore.connect(
        pg.dsn,
        min_size=pg.pool_min,
        max_size=pg.pool_max,
        command_timeout=pg.command_timeout,
        connect_timeout=pg.connect_timeout,
        grants=grants,
        new_primary_grace=pg.new_primary_grace if grants is not None else 0.0,
        lazy=lazy,
    )
    stack.push_async_callback(pool.close)
    if pool.start_error is not None:
        log.warning(
            "PostgreSQL cannot be reached yet, serving anyway: segment requests are answered "
            "'unavailable' (retryable) until it can (%s)",
            pool.start_error,  # str(): where PostgreSQL is, for the operator
        )
    else:
        log.info("connected to PostgreSQL at %s", redact(pg.dsn))
    if grants is None:
        return Postgres(pool, Off("segment.remember_grants" if config.segment.enabled else "segment.enabled"))
    return Postgres(pool, grants)


async def start_segments(
    stack: contextlib.AsyncExitStack,
    config: Config,
    clock: Clock,
    rates: RateBook,
    store: PostgresSegmentStore,
    *,
    marks: PermutedMarks | None = None,
) -> Segments:
    """The segment allocator, its tag list loaded if PostgreSQL answers, and its refresh loop.

    ``marks`` takes in the permuted tags of every tag list before the allocator learns a tag from it.
    """
    if store.connected:  # else said once already (see open_postgres); the allocator retries by itself
        await _restore_peaks(store, rates)
    allocator = SegmentAllocator(
        store if marks is None else MarkingStore(store, marks),
        clock,
        settings_of(AllocatorSettings, config.segment),
        sizer=rates.size,
        meters=rates.segment_meter,
    )
    stack.push_async_callback(_stop_segments, config, clock, allocator, store)
    try:
        if store.connected:
            await allocator.refresh()
            log.info("serving %d segment tags", len(allocator.tags))
    except DispenserError as exc:
        log.warning("could not load the tag list yet (will retry): %s", exc)
    background(stack, allocator.run_refresh_loop(), "segment-refresh")
    return Segments(allocator, store)


_RETURN_WITHIN = 2.0
"""Seconds the return may take at most, out of the stop's 8 (a silent database must not hold the exit)."""


async def _stop_segments(
    config: Config, clock: Clock, allocator: SegmentAllocator, store: PostgresSegmentStore
) -> None:
    """Close the allocator; first, with ``segment.return_unused``, give its unused IDs back (docs/segment.md).

    Run after every transport has stopped (the stack unwinds in reverse): the buffers are closed before
    their rest is read, so no late answer carries a returned ID.
    """
    if config.segment.return_unused and store.connected:
        worker = f"{socket.gethostname()}:{os.getpid()}"
        await return_unused(
            allocator, store, worker, clock, min(config.postgres.command_timeout, _RETURN_WITHIN)
        )
    await allocator.close()


async def open_replay_store(
    stack: contextlib.AsyncExitStack, config: Config, postgres: Postgres | Off, *, lazy: bool
) -> tuple[Postgres | Off, PostgresReplayStore | Off]:
    """The fleet-wide store of answers to requests with a ``request_id`` (``limits.dedup_store``).

    Returns:
        The PostgreSQL pool (``postgres``, or opened here for the replay store), and the replay store.
    """
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
        return postgres, Off("limits.dedup_store")
    if isinstance(postgres, Off):
        postgres = await open_postgres(stack, config, lazy=lazy)
    store = PostgresReplayStore(postgres.pool)
    background(stack, _sweep_replays(store, config.limits.dedup_ttl), "replay-sweep")
    return postgres, store


async def _sweep_replays(store: PostgresReplayStore, ttl: float) -> None:
    """Delete expired answers every TTL (any worker may; the delete is idempotent)."""
    interval = max(ttl, 1.0)
    while True:
        await asyncio.sleep(interval)
        try:
            swept = await store.sweep()
        except DispenserError as exc:
            log.debug("could not sweep expired request answers (will retry): %s", exc)
            continue
        if swept:
            log.debug("swept %d expired request answers", swept)


async def _restore_peaks(store: PostgresSegmentStore, rates: RateBook) -> None:
    """Start from the saved fleet peaks (a restart at peak time, of any number of workers, sizes from them)."""
    try:
        peaks = await store.load_peaks("segment")
    except DispenserError as exc:
        log.warning("could not load the saved rate peaks (sizing from scratch): %s", exc)
        return
    rates.restore("segment", peaks)
    if peaks:
        log.info("restored the rate peaks of %d tag(s)", len(peaks))


async def start_residues(
    stack: contextlib.AsyncExitStack, config: Config, rates: RateBook, segments: Segments, nc: Connection
) -> ResidueGuard:
    """Claim each tag's class at its first segment, against the other databases' (docs/datacenters.md)."""
    prefix = config.nats.subject_prefix
    subject, check_subject = residue_subject(prefix), residue_check_subject(prefix)
    store, allocator = segments.store, segments.allocator

    async def database() -> Database:
        return await database_of(store)

    async def announce_claims(claims: list[ResidueClaim]) -> None:
        await announce(nc, subject, guard, claims)

    guard = ResidueGuard(
        rates.worker,
        database,
        announce_claims,
        datacenter=config.nats.datacenter,
        on_refuse=allocator.refuse,
    )
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
    background(stack, _recheck_residues(config, guard, nc, check_subject), "residue-checks")
    return guard


async def _recheck_residues(config: Config, guard: ResidueGuard, nc: Connection, subject: str) -> None:
    """Check the claims again now and then: a worker that missed an announcement hears it here."""
    segment = config.segment
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
