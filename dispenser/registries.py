"""Choosing and opening the snowflake worker-ID registry from config, with the local cache as fallback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dispenser.adapters.local.statefile import (
    LocalState,
    LocalStateFile,
    RegistryMode,
    WorkerIdentity,
    default_state_dir,
    state_file_path,
)
from dispenser.config import PostgresConfig, SnowflakeConfig
from dispenser.core.errors import CoordinatorUnavailable, InvalidLayout, LeaseLost
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.ports import Clock, WorkerLease, WorkerRegistry

__all__ = ["SnowflakeRegistration", "default_address", "layout_of", "open_registration", "open_registry"]

log = logging.getLogger(__name__)


def layout_of(config: SnowflakeConfig) -> SnowflakeLayout:
    """The configured bit layout.

    Raises:
        InvalidLayout: the bits overflow 63 or the layout cannot be used.
        WorkerIdOutOfRange: ``datacenter_id`` does not fit ``datacenter_bits``.
    """
    layout = SnowflakeLayout(
        timestamp_bits=config.timestamp_bits,
        worker_bits=config.worker_bits,
        sequence_bits=config.sequence_bits,
        epoch_ms=config.epoch_ms,
        datacenter_bits=config.datacenter_bits,
    )
    layout.node_part(config.datacenter_id, 0)  # the datacenter ID must fit its field
    return layout


def default_address() -> str:
    """``<this host's IP>:<process ID>``: unique per process, but not stable across restarts."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            ip = probe.getsockname()[0]
    except OSError:
        ip = "127.0.0.1"
    return f"{ip}:{os.getpid()}"


LEAF_ROOT = "/snowflake"
"""Leaf's ZooKeeper root (``SnowflakeZookeeperHolder``: ``"/snowflake/" + leaf.name``, not configurable)."""

LEAF_UPLOAD_INTERVAL = 3.0
"""Seconds between a live Leaf server's rewrites of its worker node (``ScheduledUploadData``'s fixed delay)."""

LEAF_QUIET_WINDOW = 2 * LEAF_UPLOAD_INTERVAL + 1.0
"""Sharing Leaf's registry: a worker node rewritten less than this long ago may be a live Leaf server's.

Two of Leaf's intervals (one upload may fail or come late: a ZooKeeper blip, a GC pause) and a second more.
A worker takes its address's existing node only once it has been quiet this long (docs/migrating-from-leaf.md).
"""

LEAF_LAYOUT = (41, 10, 12)
"""Leaf's timestamp, worker and sequence bits (``SnowflakeIDGenImpl``), with no datacenter field."""


def check_leaf_sharing(config: SnowflakeConfig, address: str) -> None:
    """With Leaf's own root, refuse what would let a Leaf server and this worker issue the same IDs, or break Leaf.

    Sharing ``/snowflake/<name>/forever`` keeps worker IDs apart only if both number the same field: Leaf's
    layout. Only ``zookeeper`` mode takes Leaf's sequence numbers; digest credentials would restrict
    Leaf's nodes to our identity; and Leaf reads every node name with ``split("-")``, so an address with
    a ``-`` would make Leaf's start fail (docs/migrating-from-leaf.md).

    Raises:
        InvalidLayout: the layout, mode, credentials or address cannot share Leaf's registry.
    """
    if config.mode not in ("zookeeper", "zookeeper-lease") or config.zookeeper_root != LEAF_ROOT:
        return
    why = f"snowflake.zookeeper_root = {LEAF_ROOT!r} shares Leaf's registry, which needs"
    bits = (config.timestamp_bits, config.worker_bits, config.sequence_bits)
    if config.mode != "zookeeper":
        raise InvalidLayout(f"{why} mode 'zookeeper' (Leaf's scheme), not {config.mode!r}")
    if bits != LEAF_LAYOUT or config.datacenter_bits:
        raise InvalidLayout(
            f"{why} Leaf's layout 41 + 10 + 12 bits without a datacenter field (worker IDs keep IDs apart "
            f"only in the same field), not {config.timestamp_bits} + {config.datacenter_bits} + "
            f"{config.worker_bits} + {config.sequence_bits}"
        )
    if config.zookeeper_auth is not None:
        raise InvalidLayout(f"{why} open nodes: zookeeper_auth would lock Leaf's servers out of them")
    if "-" in address:
        raise InvalidLayout(
            f"{why} an address without '-' (Leaf splits every node name at '-'), not {address!r}: "
            'set snowflake.address = "ip:port"'
        )


def open_registry(
    config: SnowflakeConfig, postgres: PostgresConfig, layout: SnowflakeLayout, address: str, clock: Clock
) -> WorkerRegistry:
    """The registry of the configured mode (not yet registered).

    Raises:
        InvalidLayout: the configuration cannot share Leaf's registry (see :func:`check_leaf_sharing`).
    """
    check_leaf_sharing(config, address)
    max_worker_id = layout.max_worker_id
    if config.mode in ("zookeeper", "zookeeper-lease"):
        # kazoo only when used
        from dispenser.adapters.zookeeper.lease import ZooKeeperLeaseRegistry  # noqa: PLC0415
        from dispenser.adapters.zookeeper.registry import ZooKeeperRegistry  # noqa: PLC0415

        registry_class = ZooKeeperRegistry if config.mode == "zookeeper" else ZooKeeperLeaseRegistry
        registry = registry_class(
            config.zookeeper_hosts,
            config.name,
            address,
            max_worker_id=max_worker_id,
            session_timeout=config.zookeeper_session_timeout,
            connect_timeout=config.zookeeper_connect_timeout,
            op_timeout=config.zookeeper_op_timeout,
            clock=clock,
            auth=config.zookeeper_auth,
            world_read=config.zookeeper_world_read,
            root=config.zookeeper_root,
            # Each datacenter numbers its workers in its own namespace (one ensemble spanning them).
            datacenter=config.datacenter_id if layout.datacenter_bits else None,
        )
        if isinstance(registry, ZooKeeperRegistry) and config.zookeeper_root == LEAF_ROOT:
            # Sharing Leaf's registry: a node a live Leaf server keeps fresh is not taken.
            registry.quiet_window = LEAF_QUIET_WINDOW
        return registry
    if config.mode == "postgres":
        from dispenser.adapters.postgres.workers import PostgresWorkerRegistry  # noqa: PLC0415

        return PostgresWorkerRegistry(postgres.dsn, address, max_worker_id=max_worker_id)
    from dispenser.adapters.local.static_registry import StaticRegistry  # noqa: PLC0415

    # Its high water lives in the local cache that SnowflakeRegistration keeps for every mode.
    return StaticRegistry(config.worker_id, max_worker_id=max_worker_id)


_DEFAULT_ZOOKEEPER_ROOT = "/leaf/snowflake"


def cache_namespace(config: SnowflakeConfig, layout: SnowflakeLayout) -> str:
    """What a cached worker ID belongs to: the registry's name, root and datacenter.

    A cache written under another root (Leaf's ``/snowflake`` shared, say) or another datacenter holds an
    ID from another numbering: starting from it while the registry is down could take a live worker's ID.
    The default root without datacenter bits keeps the bare name, as caches written before both existed.
    """
    namespace = config.name
    if config.mode in ("zookeeper", "zookeeper-lease") and config.zookeeper_root != _DEFAULT_ZOOKEEPER_ROOT:
        namespace += f"@{config.zookeeper_root}"
    if layout.datacenter_bits:
        namespace += f"/dc-{config.datacenter_id}"
    return namespace


@dataclass
class SnowflakeRegistration:
    """A registered worker: its layout, registry, lease and how to record its high-water mark."""

    layout: SnowflakeLayout
    registry: WorkerRegistry
    lease: WorkerLease
    cache: LocalStateFile
    mode: RegistryMode
    name: str
    """The namespace the worker ID belongs to (:func:`cache_namespace`), recorded with it in the cache."""
    from_cache: bool
    """True when the registry could not be reached and the worker ID came from the local cache."""
    identity: WorkerIdentity | None = None
    """The stable address this worker registered under, locked until :meth:`close`."""
    registry_wait: float = 0.5
    """Seconds :meth:`persist` waits for the registry outside ``zookeeper-lease`` mode before leaving the
    report to finish in the background (the local cache already holds the mark)."""
    address: str = ""
    """The address this worker registered under (named when a peer claims the same ID)."""
    _reporting: asyncio.Task[None] | None = dataclasses.field(default=None, init=False, repr=False)
    _to_report: int = dataclasses.field(default=0, init=False, repr=False)
    _on_cached_id: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._on_cached_id = self.from_cache

    # -- the registry as the generator sees it: like `registry`, but a start from the cache may issue ----

    async def register(self) -> WorkerLease:
        """Register with the registry; from then on, it alone decides whether this worker may issue.

        Raises:
            the registry's errors (see :meth:`dispenser.ports.WorkerRegistry.register`).
        """
        try:
            lease = await self.registry.register()
        except CoordinatorUnavailable:
            raise
        except BaseException:
            # Registered under this address or not (the address is in use, the IDs ran out): stop trusting
            # the cached ID, and let the registry say no until a registration succeeds.
            self._on_cached_id = False
            raise
        self._on_cached_id = False
        return lease

    async def report(self, high_water_ms: int) -> None:
        """The registry's :meth:`~dispenser.ports.WorkerRegistry.report`."""
        await self.registry.report(high_water_ms)

    def can_issue(self) -> bool:
        """True while running on the cached worker ID (the registry was down at start), else the registry's.

        Outside ``zookeeper-lease`` mode (where no start from the cache happens) the ID is this address's
        for good, so the cached one may be used until the registry is reached again; the registry itself
        says no until then, since it is not registered.
        """
        return self._on_cached_id or self.registry.can_issue()

    @property
    def registry_outage(self) -> float:
        """Seconds of registry outage the reservation must cover (see ``SnowflakeSettings.registry_outage``).

        The lease's issue window in ``zookeeper-lease`` mode (its mark must be in ZooKeeper before IDs go
        out); 0 in the other modes, where the local cache alone holds a reservation up.
        """
        return float(getattr(self.registry, "issue_window", 0.0)) if self.mode == "zookeeper-lease" else 0.0

    async def persist(self, worker_id: int, high_water_ms: int) -> None:
        """Record the mark in the local cache, then in the registry.

        In ``zookeeper-lease`` mode the registry's record is what the next holder of the ID waits for,
        so failing to write it fails the reservation; in the other modes the local cache is enough while
        the registry is away: the registry gets at most ``registry_wait`` seconds, then the report goes on
        in the background (one at a time, always with the newest mark), so that a registry that hangs
        (ZooKeeper down: every call waits for its timeout) never holds up the reservation, and with it
        every request.

        Raises:
            OSError: the local cache could not be written.
            CoordinatorUnavailable: (lease mode) the registry could not be written.
            LeaseLost: (lease mode) the registry says this worker no longer holds the ID. In the other
                modes the registry remembers it and ``can_issue()`` turns false.
        """
        state = LocalState(
            worker_id=worker_id, high_water_ms=high_water_ms, mode=self.mode, registry_name=self.name
        )
        await self.cache.asave(state)
        if self.mode == "zookeeper-lease":
            await self.registry.report(high_water_ms)
            return
        self._to_report = max(self._to_report, high_water_ms)
        if self._reporting is None or self._reporting.done():
            self._reporting = asyncio.create_task(self._report(), name="snowflake-report")
        # shield: a report that outlives the wait must go on, not be cancelled half-way.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reporting), self.registry_wait)

    async def persist_clean_stop(self, worker_id: int, last_ms: int, reserved_ms: int) -> None:
        """Record a clean stop: the exact last millisecond issued, and the highest mark reserved.

        The registries keep only their highest mark (a late write must never lower it), so the registry
        still holds the reservation, up to two report intervals ahead. The next start reads this record
        and, if the registry's mark is not above ``reserved_ms`` (nobody wrote after us), starts from
        ``last_ms`` instead of waiting the reservation out.

        Raises:
            OSError: the local cache could not be written (the reservation then stands).
        """
        state = LocalState(
            worker_id=worker_id,
            high_water_ms=last_ms,
            mode=self.mode,
            registry_name=self.name,
            clean_stop_reserved_ms=reserved_ms,
        )
        await self.cache.asave(state)

    async def _report(self) -> None:
        reported = -1
        while self._to_report > reported:
            value = self._to_report
            try:
                await self.registry.report(value)
            except CoordinatorUnavailable as exc:
                log.debug("registry unavailable; the high-water mark is in the local cache: %s", exc)
                return
            except LeaseLost as exc:
                log.warning("%s", exc)  # the registry now answers can_issue() with False
                return
            reported = value

    async def close(self, timeout: float = 10.0) -> None:
        """Let a report in progress finish (at most ``timeout`` seconds), then close the registry."""
        task, self._reporting = self._reporting, None
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(task, timeout)
            except TimeoutError:
                log.warning("the last high-water report to the registry did not finish in %g s", timeout)
        try:
            await self.registry.close()
        finally:
            if self.identity is not None:
                self.identity.release()


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
    directory = Path(config.state_dir) if config.state_dir else default_state_dir()
    identity = None
    if config.address is not None:
        address = config.address
    elif config.mode == "static":
        address = default_address()  # a static worker's ID comes from config; the address is only a label
    else:
        try:
            identity = WorkerIdentity.claim(directory, config.name)
        except OSError as exc:
            address = default_address()
            log.warning(
                "snowflake.address is not set and no identity could be kept in %s (%s): registering as %s, "
                "which changes at every start and so takes a new worker ID each time (%d in all); set "
                "snowflake.state_dir to a writable directory or a stable, distinct snowflake.address",
                directory,
                exc,
                address,
                layout.max_worker_id + 1,
            )
        else:
            address = identity.address
            log.info("registering as %s (the identity kept in %s)", address, identity.path)
    try:
        return await _register(
            config, postgres, clock, layout=layout, directory=directory, address=address, identity=identity
        )
    except BaseException:
        if identity is not None:
            identity.release()
        raise


async def _register(
    config: SnowflakeConfig,
    postgres: PostgresConfig,
    clock: Clock,
    *,
    layout: SnowflakeLayout,
    directory: Path,
    address: str,
    identity: WorkerIdentity | None,
) -> SnowflakeRegistration:
    # The default address holds the process ID, so it changes at every start. A static worker's record is
    # its only protection against reissuing after a crash and a clock rollback (Leaf #216): without a
    # configured address, name its file after the worker ID (which no two workers share) so it is found.
    owner = address if config.address or config.mode != "static" else f"worker-{config.worker_id}"
    cache = LocalStateFile(state_file_path(directory, config.name, owner))
    cached = cache.load()
    namespace = cache_namespace(config, layout)
    if cached is not None and not cached.matches(config.mode, namespace):
        cached = None
    registry = open_registry(config, postgres, layout, address, clock)
    from_cache = False
    try:
        lease = await registry.register()
    except CoordinatorUnavailable as exc:
        # Sharing Leaf's registry, only ZooKeeper can show that no live Leaf server keeps this address's
        # node fresh (a Leaf server may have started with it while this worker was stopped): no cache start.
        if cached is None or config.mode == "zookeeper-lease" or config.zookeeper_root == LEAF_ROOT:
            await _close_quietly(registry)
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
    except BaseException:
        await _close_quietly(registry)  # e.g. WorkerIdsExhausted: don't leave its session open
        raise
    lease = _merge_cached(lease, cached)
    return SnowflakeRegistration(
        layout,
        registry,
        lease,
        cache,
        config.mode,
        namespace,
        from_cache,
        identity=identity,
        registry_wait=min(0.5, config.report_interval / 2),
        address=address,
    )


def _merge_cached(lease: WorkerLease, cached: LocalState | None) -> WorkerLease:
    """The high-water mark to honour: the registry's, the cache's, or a clean stop's exact last millisecond."""
    if cached is None or cached.worker_id != lease.worker_id:
        return lease
    reserved = cached.clean_stop_reserved_ms
    if reserved is not None and lease.high_water_ms <= reserved:
        # The registry holds at most what the last run reserved, and that run stopped cleanly after
        # issuing nothing past cached.high_water_ms: a later holder of the ID would have raised the mark
        # past our reservation before issuing anything.
        if cached.high_water_ms < lease.high_water_ms:
            log.info(
                "clean restart: the last run issued up to %d, so the reservation up to %d need not be waited out",
                cached.high_water_ms,
                lease.high_water_ms,
            )
        return dataclasses.replace(lease, high_water_ms=cached.high_water_ms)
    if cached.high_water_ms > lease.high_water_ms:
        return dataclasses.replace(lease, high_water_ms=cached.high_water_ms)
    return lease


async def _close_quietly(registry: WorkerRegistry) -> None:
    """Close a registry whose registration failed, keeping the registration's error the one raised."""
    try:
        await registry.close()
    except Exception as exc:
        log.debug("closing %r after a failed registration: %s", registry, exc)
