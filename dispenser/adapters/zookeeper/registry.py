"""Snowflake worker IDs from ZooKeeper, Leaf's way, and what both ZooKeeper registries share.

:class:`ZooKeeperRegistry` (``zookeeper``): a persistent sequential node per ``ip:port`` under
``forever/`` (its sequence is the worker ID, for good), an ephemeral one under ``temporary/`` while alive;
the shell calls :meth:`~ZooKeeperRegistry.report` on its own timer. The session lives in
:mod:`~dispenser.adapters.zookeeper.session` (its public names importable from here too). The modes and
the weak dependency on ZooKeeper: ``docs/snowflake.md``. An error's ``message`` (what a request may be
answered) names no node path and no ZooKeeper host; ``str(error)`` does, for the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

import msgspec

from dispenser.adapters.zookeeper.acl import check_auth, digest_id, registry_acl, shared_acl
from dispenser.adapters.zookeeper.session import BadVersion, NodeExists, NodeStat, NoNode, ZkSession
from dispenser.core.errors import (
    CoordinatorUnavailable,
    LeaseLost,
    WorkerAddressInUse,
    WorkerIdOutOfRange,
    WorkerIdsExhausted,
    WorkerNodeAlive,
)
from dispenser.ports import Clock, SystemClock, WorkerLease

__all__ = [
    "DEFAULT_ROOT",
    "NodeData",
    "ZkRegistryBase",
    "ZkSession",
    "ZooKeeperRegistry",
    "check_address",
    "check_auth",
    "check_name",
    "decode_node",
    "digest_id",
    "encode_node",
    "parse_worker_node",
    "registry_acl",
    "shared_acl",
]

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/leaf/snowflake"
"""Parent of every registry namespace (``<root>/<name>/...``); Leaf itself used ``/snowflake``."""

_SEQUENCE_DIGITS = 10  # ZooKeeper's sequential suffix: %010d
_WATCH_POLL = 0.25  # seconds between two reads of a worker node watched for someone else's writes
_SYSTEM_CLOCK = SystemClock()
_CAS_ATTEMPTS = 20


class NodeData(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """The JSON a worker node (and a lease's high-water node) holds: who wrote it, and the timestamp.

    ``port`` is a string because Leaf's ``Endpoint`` writes it so; numbers are read too.
    """

    ip: str = ""
    port: str | int = ""
    timestamp: int = 0


_node_encoder = msgspec.json.Encoder()
_node_decoder = msgspec.json.Decoder(NodeData)


def encode_node(address: str, timestamp: int) -> bytes:
    """Return the node data for ``address`` (``ip:port``) and ``timestamp``."""
    ip, _, port = address.rpartition(":")
    return _node_encoder.encode(NodeData(ip=ip, port=port, timestamp=timestamp))


def decode_node(data: bytes | None, path: str) -> NodeData:
    """Parse node data; empty data reads as timestamp 0.

    Raises:
        CoordinatorUnavailable: the node holds something else (a person must look at it: never guess a
            timestamp, since a low guess could let IDs repeat).
    """
    if not data:
        return NodeData()
    try:
        return _node_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CoordinatorUnavailable(
            "a node holds data that is not a worker record; details in the worker's log",
            logged=f"znode {path} holds data that is not a worker record: {exc}",
        ) from exc


def check_name(name: str) -> str:
    """Validate a registry namespace (one znode name).

    Raises:
        ValueError: empty, ``.``/``..``, or containing ``/``.
    """
    if not name or "/" in name or name in {".", ".."}:
        raise ValueError(f"registry name {name!r} must be one non-empty path segment without '/'")
    return name


def check_address(address: str) -> str:
    """Validate a worker address ``host:port`` (it becomes part of a znode name).

    Raises:
        ValueError: no ``:``, an empty host or port, or a ``/``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port or "/" in address:
        raise ValueError(f"worker address {address!r} must look like ip:port")
    return address


def parse_worker_node(name: str) -> tuple[str, int] | None:
    """Split ``ip:port-0000000003`` into ``("ip:port", 3)``; None for a name that is not a worker node."""
    address, sep, sequence = name.rpartition("-")
    if not sep or not address or len(sequence) != _SEQUENCE_DIGITS or not sequence.isdigit():
        return None
    return address, int(sequence)


class ZkRegistryBase:
    """What both ZooKeeper registries share: the namespace, the worker address, the session and the lease state.

    Args:
        hosts: ZooKeeper connection string, ``host:port[,host:port...]``.
        name: The registry namespace: nodes live under ``<root>/<name>/``.
        address: This worker's ``ip:port``.
        max_worker_id: The layout's largest worker ID (``2**worker_bits - 1``).
        root: Parent of the namespaces.
        session_timeout: Seconds asked for as the ZooKeeper session timeout.
        connect_timeout: Seconds :meth:`register` may spend connecting.
        op_timeout: Seconds one ZooKeeper call may take.
        clock: The clock (the wall clock stamps the nodes written; the lease registry times its
            confirmations with the monotonic one).
        auth: Digest credentials ``user:password``: the session presents them and the nodes it creates
            are writable by that identity only (see the module docstring). None: open nodes.
        world_read: With ``auth``, let anyone read the registry's nodes.
        datacenter: The layout's datacenter ID when it has datacenter bits: the namespace is then
            ``<root>/<name>/dc-<datacenter>``, so that one ensemble spanning datacenters numbers each
            datacenter's workers on its own. None: ``<root>/<name>`` (Leaf's layout).
    """

    mode: ClassVar[str]
    _HOME: ClassVar[str]
    """The child of ``<root>/<name>/`` that names this registry in messages."""

    def __init__(
        self,
        hosts: str,
        name: str,
        address: str,
        *,
        max_worker_id: int,
        root: str = DEFAULT_ROOT,
        session_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        op_timeout: float = 5.0,
        clock: Clock = _SYSTEM_CLOCK,
        auth: str | None = None,
        world_read: bool = True,
        datacenter: int | None = None,
    ) -> None:
        if max_worker_id < 0:
            raise ValueError(f"max_worker_id must be at least 0, got {max_worker_id}")
        self.name = check_name(name)
        self.address = check_address(address)
        self.max_worker_id = max_worker_id
        self.root_path = "/" + "/".join(p for p in root.split("/") if p)
        place = () if datacenter is None else (f"dc-{datacenter}",)
        self.base_path = "/" + "/".join(p for p in (*root.split("/"), name, *place) if p)
        self._clock = clock
        self._zk = ZkSession(
            hosts,
            session_timeout=session_timeout,
            connect_timeout=connect_timeout,
            op_timeout=op_timeout,
            auth=auth,
            world_read=world_read,
        )
        self._lock = asyncio.Lock()
        self._worker_id: int | None = None
        self._reported = 0
        self._lost: str | None = None
        """Why the worker ID was lost (the caller's words; None: not lost); see :meth:`_lose`."""
        self._lost_logged = ""
        """The same, with the node's path (the log's words)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._zk.hosts!r}, {self._home!r}, {self.address!r})"

    @property
    def worker_id(self) -> int | None:
        """The worker ID once registered (in lease mode: of the current or last lease)."""
        return self._worker_id

    @property
    def session(self) -> ZkSession:
        """The ZooKeeper session (for tests and diagnostics)."""
        return self._zk

    async def _raise_timestamp(self, path: str, timestamp: int, *, create: bool) -> int:
        """Make the node's timestamp ``max(current, timestamp)`` with a compare-and-set; return the result.

        The node is a max register: concurrent or late writers (a worker that lost its lease) can only
        raise it, never lower it. The writer recorded with it is this worker's address.

        Args:
            path: The node.
            timestamp: Unix ms.
            create: Create the node when missing; otherwise a missing node raises :data:`NoNode`.
        """
        for _ in range(_CAS_ATTEMPTS):
            found = await self._zk.get(path)
            if found is None:
                if not create:
                    raise NoNode()
                try:
                    await self._zk.create(path, encode_node(self.address, timestamp))
                except NodeExists:
                    continue
                return timestamp
            data, stat = found
            value = max(decode_node(data, path).timestamp, timestamp)
            try:
                await self._zk.set(path, encode_node(self.address, value), stat.version)
            except BadVersion:
                continue
            return value
        raise CoordinatorUnavailable(
            f"raising a node's timestamp: {_CAS_ATTEMPTS} concurrent updates in a row",
            logged=f"writing {path}: {_CAS_ATTEMPTS} concurrent updates in a row",
        )

    def _lose(self, worker_id: int, detail: str, logged: str | None = None) -> LeaseLost:
        """Remember that the worker ID is lost and return the error saying so.

        Args:
            worker_id: the ID lost.
            detail: why, in words that name no node path and no host (a request may be answered them).
            logged: the same, with the node's path, for the log (default: ``detail``).
        """
        self._lost, self._lost_logged = detail, detail if logged is None else logged
        return self._lost_error(worker_id)

    def _lost_error(self, worker_id: int) -> LeaseLost:
        """The :class:`LeaseLost` for the loss remembered by :meth:`_lose`."""
        return LeaseLost(worker_id, self._lost or "", logged=self._lost_logged or None)

    @property
    def _home(self) -> str:
        return f"{self.base_path}/{self._HOME}"

    @property
    def _where(self) -> str:
        return f"ZooKeeper {self._zk.hosts} {self._home}"


# --- Leaf's mode ------------------------------------------------------------------------------------------


class ZooKeeperRegistry(ZkRegistryBase):
    """:class:`~dispenser.ports.WorkerRegistry` in Leaf's ``zookeeper`` mode (see the module docstring).

    Takes the arguments of :class:`ZkRegistryBase`; the same ``address`` gets the same worker ID back,
    and ``session_timeout`` is how long ZooKeeper keeps the ephemeral node after the worker vanishes.

    Args:
        quiet_window: Sharing Leaf's registry (``root`` ``/snowflake``), where a live Leaf server holds no
            ephemeral node but rewrites its worker node every 3 s: an existing node for this address
            written less than this many seconds ago (ZooKeeper's clock) is watched until it has been
            quiet that long, and refused (:class:`~dispenser.core.errors.WorkerNodeAlive`) if someone else
            rewrites it meanwhile; and while registered, a report that finds the node rewritten by
            someone else loses the ID (:class:`~dispenser.core.errors.LeaseLost`). 0: neither (the
            dispenser's own root, where no Leaf server writes).
        **base: The arguments of :class:`ZkRegistryBase`.
    """

    mode = "zookeeper"
    _HOME = "forever"
    _node: str | None = None  # our node under forever/, once registered
    _session_id: int | None = None  # the session holding our temporary node
    _version: int | None = None  # with quiet_window: the node's data version after our last write
    _pending: tuple[int, bytes] | None = None  # a write whose answer may be lost: (its version, its data)

    def __init__(
        self, hosts: str, name: str, address: str, *, quiet_window: float = 0.0, **base: Any
    ) -> None:
        super().__init__(hosts, name, address, **base)
        self.quiet_window = quiet_window

    @property
    def forever_path(self) -> str:
        """``<root>/<name>/forever``: one persistent sequential node per worker address."""
        return f"{self.base_path}/forever"

    @property
    def temporary_path(self) -> str:
        """``<root>/<name>/temporary``: the ephemeral node of each live worker."""
        return f"{self.base_path}/temporary"

    async def register(self) -> WorkerLease:
        """Find or create this address's worker node and hold the ephemeral node.

        If another session holds ``temporary/<address>`` (typically this worker's previous run, killed less
        than a session timeout ago), waits up to one session timeout for it to go away.

        Returns:
            The worker ID, and the node's recorded timestamp as ``high_water_ms`` (0 for a new node).

        Raises:
            WorkerIdsExhausted: the sequence number ZooKeeper gave a new node is over ``max_worker_id``
                (the node is deleted again).
            WorkerIdOutOfRange: this address's existing node has an ID over ``max_worker_id`` (the layout
                shrank).
            WorkerAddressInUse: another live session holds this address's ephemeral node.
            CoordinatorUnavailable: ZooKeeper did not answer in time.
        """
        async with self._lock:
            await self._zk.open()
            await self._zk.ensure_path(self.forever_path, shared=self.root_path)
            await self._zk.ensure_path(self.temporary_path, shared=self.root_path)
            for path in (self.base_path, self.forever_path, self.temporary_path):
                await self._zk.restrict(path)
            workers = await self._zk.children(self.forever_path)
            mine: list[int] = []
            for child in workers:
                parsed = parse_worker_node(child)
                if parsed is None:
                    continue
                if parsed[0] == self.address:
                    mine.append(parsed[1])
            if mine:
                worker_id = min(mine)
                if len(mine) > 1:
                    log.warning(
                        "%s has %d worker nodes for %s; using the lowest", self, len(mine), self.address
                    )
                node = f"{self.forever_path}/{self.address}-{worker_id:0{_SEQUENCE_DIGITS}d}"
                found = await self._zk.get(node)
                if found is None:
                    raise _vanished(node)
                recorded = decode_node(found[0], node).timestamp
                if worker_id > self.max_worker_id:
                    raise WorkerIdOutOfRange(worker_id, self.max_worker_id)
                await self._zk.restrict(node)
            else:
                node = await self._zk.create(
                    f"{self.forever_path}/{self.address}-",
                    encode_node(self.address, self._clock.wall_ms()),
                    sequential=True,
                )
                parsed = parse_worker_node(node.rpartition("/")[2])
                if parsed is None:
                    raise CoordinatorUnavailable(
                        "ZooKeeper created an unexpected node",
                        logged=f"ZooKeeper created an unexpected node {node}",
                    )
                worker_id = parsed[1]
                recorded = 0
                if worker_id > self.max_worker_id:
                    # Useless to anyone (sequence numbers only grow); don't leave it to look like a worker.
                    with contextlib.suppress(NoNode, CoordinatorUnavailable):
                        await self._zk.delete(node)
                    raise WorkerIdsExhausted(self.max_worker_id + 1, self._where)
                log.info("%s: new worker node %s", self, node)
            await self._hold_temporary(wait=True)
            if self.quiet_window > 0:
                # No other dispenser worker holds this address (the temporary node); a Leaf server holds
                # none, but keeps its node fresh. A new node was just created: version 0, nobody else's.
                self._version = await self._watch(node, worker_id) if mine else 0
                self._pending = None
            self._node = node
            self._worker_id = worker_id
            self._lost = None
            self._reported = max(self._reported, recorded)
            return WorkerLease(worker_id=worker_id, high_water_ms=recorded)

    async def _hold_temporary(self, *, wait: bool) -> None:
        """Hold ``temporary/<address>`` in the current session (or find it already held by it)."""
        path = f"{self.temporary_path}/{self.address}"
        data = encode_node(self.address, max(self._reported, self._clock.wall_ms()))
        deadline = time.monotonic() + (self._zk.timeout + 1.0 if wait else 0.0)
        while True:
            with contextlib.suppress(NodeExists):
                await self._zk.create(path, data, ephemeral=True)
            found = await self._zk.get(path)
            if found is None:
                continue  # it went away in between
            owner = found[1].ephemeral_owner
            if owner == self._zk.session_id:
                self._session_id = owner
                return
            if owner in self._zk.own_session_ids:
                # An earlier session of ours that the client gave up on but the server has not expired yet.
                with contextlib.suppress(NoNode):
                    await self._zk.delete(path)
                continue
            if time.monotonic() >= deadline:
                raise WorkerAddressInUse(self.address, self._where)
            await asyncio.sleep(0.1)

    async def _watch(self, node: str, worker_id: int) -> int:
        """Take ``node`` only once it has been quiet for ``quiet_window`` s; return its data version.

        Raises:
            WorkerNodeAlive: someone else rewrote it meanwhile (a live Leaf server, every 3 s).
            CoordinatorUnavailable: it vanished, or ZooKeeper did not answer in time.
        """
        data, stat = await self._read_node(node)
        quiet_s = (await self._zookeeper_now() - stat.mtime) / 1000
        left = self.quiet_window - quiet_s
        if left <= 0:
            return stat.version
        log.info(
            "%s: worker node %s was written %.1f s ago (by %s): watching it for %.1f s, since a live Leaf "
            "server rewrites its node every 3 s",
            self,
            node,
            max(quiet_s, 0.0),
            _writer(data, node),
            left,
        )
        deadline = self._clock.monotonic() + left
        while (wait := deadline - self._clock.monotonic()) > 0:
            await self._clock.sleep(min(_WATCH_POLL, wait))
            again, again_stat = await self._read_node(node)
            if again_stat.version != stat.version:
                raise WorkerNodeAlive(node, worker_id, _writer(again, node), self.quiet_window)
        return stat.version

    async def _read_node(self, node: str) -> tuple[bytes, NodeStat]:
        found = await self._zk.get(node)
        if found is None:
            raise _vanished(node)
        return found

    async def _zookeeper_now(self) -> int:
        """ZooKeeper's clock now (Unix ms): write our ephemeral node as it is, and read when it was written."""
        path = f"{self.temporary_path}/{self.address}"
        data, _ = await self._read_node(path)
        await self._zk.set(path, data, -1)
        return (await self._read_node(path))[1].mtime

    async def _raise_own_node(self, node: str) -> None:
        """Raise our node's timestamp, unless someone else has written it since our last write (lost, then)."""
        data, stat = await self._read_node(node)
        if stat.version != self._version and (stat.version, data) != self._pending:
            why = (
                "as a live Leaf server rewrites its node every 3 s: two workers on one worker ID would issue "
                "the same IDs"
            )
            raise self._lose(
                self._worker_id or 0,
                f"its node was rewritten by someone else, {why}",
                f"its node {node} was rewritten by someone else ({_writer(data, node)}), {why}",
            )
        value = max(decode_node(data, node).timestamp, self._reported)
        written = encode_node(self.address, value)
        self._pending = (stat.version + 1, written)
        try:
            await self._zk.set(node, written, stat.version)
        except BadVersion:
            raise self._lose(
                self._worker_id or 0,
                "its node was rewritten by someone else while this worker wrote it",
                f"its node {node} was rewritten by someone else while this worker wrote it",
            ) from None
        self._version, self._pending = stat.version + 1, None

    async def report(self, high_water_ms: int) -> None:
        """Raise the worker node's timestamp to ``high_water_ms``; restore the ephemeral node if needed.

        Raises:
            CoordinatorUnavailable: not registered yet, or ZooKeeper did not answer in time (the worker
                keeps issuing; call again on the next tick).
            LeaseLost: the worker node was deleted, or another live worker took this address.
        """
        if self._worker_id is None or self._node is None:
            raise CoordinatorUnavailable(
                "not registered (register() has not succeeded yet)",
                logged=f"{self}: not registered (register() has not succeeded yet)",
            )
        if self._lost is not None:
            raise self._lost_error(self._worker_id)
        self._reported = max(self._reported, high_water_ms)
        async with self._lock:
            try:
                if self._version is not None:
                    await self._raise_own_node(self._node)
                else:
                    await self._raise_timestamp(self._node, self._reported, create=False)
            except NoNode:
                raise self._lose(
                    self._worker_id, "its node was deleted", f"its node {self._node} was deleted"
                ) from None
            # Checked after a call that was answered, not before: a call made while disconnected waits
            # for the connection, which may come back on a new session (the old one expired meanwhile).
            if self._zk.session_id != self._session_id:
                log.info(
                    "%s: new ZooKeeper session; holding %s/%s again", self, self.temporary_path, self.address
                )
                try:
                    await self._hold_temporary(wait=False)
                except WorkerAddressInUse as exc:
                    raise self._lose(self._worker_id, exc.message, str(exc)) from None

    def can_issue(self) -> bool:
        """True once registered, even while ZooKeeper is down: the ID belongs to this address for good."""
        return self._worker_id is not None and self._lost is None

    async def close(self) -> None:
        """Close the session, which removes the ephemeral node; the worker node stays for the next run."""
        async with self._lock:
            self._worker_id = None
            self._node = None
            self._version = None
            await self._zk.close()


def _vanished(node: str) -> CoordinatorUnavailable:
    """This worker's node went while it registered (someone deleted it): try again."""
    return CoordinatorUnavailable(
        "the worker node vanished while registering; try again",
        logged=f"worker node {node} vanished while registering; try again",
    )


def _writer(data: bytes, node: str) -> str:
    """Who wrote a worker node, by the ``ip:port`` its data names (Leaf writes its own)."""
    try:
        record = decode_node(data, node)
    except CoordinatorUnavailable:
        return "an unknown writer"
    return f"{record.ip}:{record.port}" if record.ip else "an unknown writer"
