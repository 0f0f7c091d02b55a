"""Choosing and opening the snowflake worker-ID registry from config, with the local cache as fallback."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dispenser.adapters.statefile import (
    LocalState,
    LocalStateFile,
    RegistryMode,
    default_state_dir,
    state_file_path,
)
from dispenser.config import PostgresConfig, SnowflakeConfig
from dispenser.core.errors import CoordinatorUnavailable
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.ports import Clock, WorkerLease, WorkerRegistry

__all__ = ["SnowflakeRegistration", "default_address", "layout_of", "open_registration", "open_registry"]

log = logging.getLogger(__name__)


def layout_of(config: SnowflakeConfig) -> SnowflakeLayout:
    """The configured bit layout.

    Raises:
        InvalidLayout: the bits overflow 63 or the layout cannot be used.
    """
    return SnowflakeLayout(
        timestamp_bits=config.timestamp_bits,
        worker_bits=config.worker_bits,
        sequence_bits=config.sequence_bits,
        epoch_ms=config.epoch_ms,
    )


def default_address() -> str:
    """``<this host's IP>:<process ID>``: unique per process, but not stable across restarts."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            ip = probe.getsockname()[0]
    except OSError:
        ip = "127.0.0.1"
    return f"{ip}:{os.getpid()}"


def open_registry(
    config: SnowflakeConfig, postgres: PostgresConfig, layout: SnowflakeLayout, address: str, clock: Clock
) -> WorkerRegistry:
    """The registry of the configured mode (not yet registered)."""
    max_worker_id = layout.max_worker_id
    if config.mode == "zookeeper":
        from dispenser.adapters.zookeeper import ZooKeeperRegistry  # noqa: PLC0415 - aiozk only when used

        return ZooKeeperRegistry(
            config.zookeeper_hosts,
            config.name,
            address,
            max_worker_id=max_worker_id,
            session_timeout=config.zookeeper_session_timeout,
            wall_ms=clock.wall_ms,
        )
    if config.mode == "zookeeper-lease":
        from dispenser.adapters.zookeeper_lease import ZooKeeperLeaseRegistry  # noqa: PLC0415

        return ZooKeeperLeaseRegistry(
            config.zookeeper_hosts,
            config.name,
            address,
            max_worker_id=max_worker_id,
            session_timeout=config.zookeeper_session_timeout,
            monotonic=clock.monotonic,
        )
    if config.mode == "postgres":
        from dispenser.adapters.worker_pg import PostgresWorkerRegistry  # noqa: PLC0415

        return PostgresWorkerRegistry(postgres.dsn, address, max_worker_id=max_worker_id)
    from dispenser.adapters.static_registry import StaticRegistry  # noqa: PLC0415

    # No state file here: SnowflakeRegistration keeps the local cache for every mode, static included.
    return StaticRegistry(
        config.worker_id, max_worker_id=max_worker_id, state=None, registry_name=config.name
    )


@dataclass
class SnowflakeRegistration:
    """A registered worker: its layout, registry, lease and how to record its high-water mark."""

    layout: SnowflakeLayout
    registry: WorkerRegistry
    lease: WorkerLease
    cache: LocalStateFile
    mode: RegistryMode
    name: str
    from_cache: bool
    """True when the registry could not be reached and the worker ID came from the local cache."""

    async def persist(self, worker_id: int, high_water_ms: int) -> None:
        """Record the mark in the local cache, then in the registry.

        In ``zookeeper-lease`` mode the registry's record is what the next holder of the ID waits for,
        so failing to write it fails the reservation; in the other modes the local cache is enough while
        the registry is away.

        Raises:
            OSError: the local cache could not be written.
            CoordinatorUnavailable: (lease mode) the registry could not be written.
            LeaseLost: the registry says this worker no longer holds the ID.
        """
        state = LocalState(
            worker_id=worker_id, high_water_ms=high_water_ms, mode=self.mode, registry_name=self.name
        )
        await self.cache.asave(state)
        try:
            await self.registry.report(high_water_ms)
        except CoordinatorUnavailable as exc:
            if self.mode == "zookeeper-lease":
                raise
            log.debug("registry unavailable; the high-water mark is in the local cache: %s", exc)


async def open_registration(
    config: SnowflakeConfig, postgres: PostgresConfig, clock: Clock
) -> SnowflakeRegistration:
    """Register this worker, falling back to the local cache where that is safe.

    The high-water mark is the larger of the registry's and the cache's (when the cache belongs to the same
    mode, namespace and worker ID).

    Raises:
        InvalidLayout: bad layout.
        CoordinatorUnavailable: the registry is down and there is no usable cache (or the mode is
            ``zookeeper-lease``, where a cached ID may already be someone else's).
        WorkerIdsExhausted: no worker ID left.
        StateFileCorrupt: the cache file is unreadable.
    """
    layout = layout_of(config)
    address = config.address or default_address()
    directory = Path(config.state_dir) if config.state_dir else default_state_dir()
    cache = LocalStateFile(state_file_path(directory, config.name, address))
    cached = cache.load()
    if cached is not None and not cached.matches(config.mode, config.name):
        cached = None
    registry = open_registry(config, postgres, layout, address, clock)
    from_cache = False
    try:
        lease = await registry.register()
    except CoordinatorUnavailable as exc:
        if cached is None or config.mode == "zookeeper-lease":
            raise
        log.warning(
            "%s; starting from the local cache %s (worker ID %d, high water %d)",
            exc,
            cache.path,
            cached.worker_id,
            cached.high_water_ms,
        )
        lease = WorkerLease(cached.worker_id, cached.high_water_ms)
        from_cache = True
    if (
        cached is not None
        and cached.worker_id == lease.worker_id
        and cached.high_water_ms > lease.high_water_ms
    ):
        lease = dataclasses.replace(lease, high_water_ms=cached.high_water_ms)
    return SnowflakeRegistration(layout, registry, lease, cache, config.mode, config.name, from_cache)
