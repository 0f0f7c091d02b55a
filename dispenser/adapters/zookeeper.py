"""Snowflake worker IDs from ZooKeeper, Leaf's way, and the aiozk plumbing both ZooKeeper registries share.

**Leaf's mode** (:class:`ZooKeeperRegistry`, ``zookeeper``): each worker address ``ip:port`` owns one
persistent sequential node ``<root>/<name>/forever/<ip:port>-<10-digit sequence>``; the sequence number is
its worker ID, kept for good and found again by the same address after a restart. The node's data is
``{"ip", "port", "timestamp"}`` (``port`` a string, as Leaf's ``Endpoint`` writes it); :meth:`report` raises
the timestamp (never lowers it) every few seconds. While alive, the worker also holds the ephemeral node
``<root>/<name>/temporary/<ip:port>``, so peers can list who is live. Sequence numbers are never reused:
once they pass the layout's largest worker ID, new addresses are refused with ``WorkerIdsExhausted``.

ZooKeeper is a weak dependency here: once registered, the worker keeps issuing while ZooKeeper is down
(:meth:`ZooKeeperRegistry.can_issue` stays true, since the ID is its own for good) and, when ZooKeeper is back,
the next :meth:`~ZooKeeperRegistry.report` puts the ephemeral node back if the session was lost.

**Timers:** the shell calls ``report(high_water_ms)`` on its own timer (every 3 s, Leaf's interval), since
only it knows the high water; this mode runs no task of its own. (The lease registry in
:mod:`dispenser.adapters.zookeeper_lease` does run one, to keep proving its lease.)

**aiozk, and why the wrapper** (:class:`ZkSession`): aiozk's calls retry forever while the server is down,
so every call here runs under a timeout and its failures become :class:`CoordinatorUnavailable`.
Its reconnect back-off grows to 60 s and its handshake read has no timeout; a connection the server closes
is noticed only at the next heartbeat; ``close()`` raises and leaves tasks behind when the server is gone;
and ``ensure_path()`` asks for container nodes, which the server deletes once empty. :class:`ZkSession`
swaps in a session that reconnects within a second, notices a closed connection at once, and tears
itself down without help; paths are created as plain persistent nodes. aiozk silently starts a *new*
session when the old one expired (its ephemeral nodes gone), so the registries compare session IDs.

**Credentials and ACLs** (``snowflake.zookeeper_auth = "user:password"``): the session presents the digest
credentials on every connection (aiozk 0.32 has no ``add_auth``; ZooKeeper keeps credentials per connection,
not per session), and every node a registry creates from the namespace ``<root>/<name>`` down carries
:func:`registry_acl`: all permissions for that identity, and read for anyone if asked. So a client without
the credentials cannot create, overwrite or delete worker registrations. The shared ancestors
(``/leaf``, ``/leaf/snowflake``) get :func:`shared_acl`, which lets other identities create their own
namespaces there. Nodes that already exist keep the ACL they were created with.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import aiozk
import aiozk.connection
import aiozk.exc
import aiozk.protocol
import aiozk.session
import msgspec

from dispenser.core.errors import (
    CoordinatorUnavailable,
    LeaseLost,
    WorkerAddressInUse,
    WorkerIdOutOfRange,
    WorkerIdsExhausted,
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
    "digest_id",
    "registry_acl",
    "shared_acl",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_ROOT = "/leaf/snowflake"
"""Parent of every registry namespace (``<root>/<name>/...``); Leaf itself used ``/snowflake``."""

_SEQUENCE_DIGITS = 10  # ZooKeeper's sequential suffix: %010d
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
        raise CoordinatorUnavailable(f"znode {path} holds data that is not a worker record: {exc}") from exc


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


def check_auth(auth: str) -> str:
    """Validate digest credentials ``user:password`` (the message never repeats them).

    Raises:
        ValueError: no ``:``, or an empty user or password.
    """
    user, sep, password = auth.partition(":")
    if not sep or not user or not password:
        raise ValueError("ZooKeeper credentials must look like user:password (both non-empty)")
    return auth


def digest_id(auth: str) -> str:
    """The ACL identity ZooKeeper derives from digest credentials: ``user:base64(sha1(user:password))``.

    This is what ``DigestAuthenticationProvider.generateDigest`` computes; it is not the password, but a
    weak password can be guessed from it, so it is not logged either.
    """
    user = check_auth(auth).partition(":")[0]
    # SHA-1 because that is the scheme's definition, not a choice of ours.
    return f"{user}:{base64.b64encode(hashlib.sha1(auth.encode()).digest()).decode()}"


def registry_acl(auth: str | None, *, world_read: bool = True) -> list[Any]:
    """The ACL of the nodes of a registry namespace: everything for ``auth``'s identity, read for anyone.

    Args:
        auth: ``user:password``; None: no credentials, so the nodes are open to anyone (aiozk's default).
        world_read: Let anyone read the nodes and list their children (``world:anyone`` READ).
    """
    if auth is None:
        return [aiozk.protocol.UNRESTRICTED_ACCESS]
    acl = [_digest_all(auth)]
    if world_read:
        acl.append(aiozk.ACL.make("world", "anyone", read=True))
    return acl


def shared_acl(auth: str | None) -> list[Any]:
    """The ACL of the ancestors a registry creates above its namespace (``/leaf``, ``/leaf/snowflake``).

    Anyone may read them and create children (other teams' namespaces, with other credentials); only
    ``auth``'s identity may change, delete under or re-ACL them.
    """
    if auth is None:
        return [aiozk.protocol.UNRESTRICTED_ACCESS]
    return [_digest_all(auth), aiozk.ACL.make("world", "anyone", read=True, create=True)]


def _digest_all(auth: str) -> Any:
    return aiozk.ACL.make(
        "digest", digest_id(auth), read=True, write=True, create=True, delete=True, admin=True
    )


class _DigestAuth(aiozk.protocol.AuthRequest):  # type: ignore[misc]  # aiozk has no type hints
    """aiozk's auth request, printed without the credentials (aiozk's payload log prints requests)."""

    def __str__(self) -> str:
        return "AuthRequest(scheme=digest, auth=***)"

    __repr__ = __str__


class _QuietRefusals(logging.Filter):
    """Drop aiozk's traceback for a request the server refused (``NoAuth``, ``InvalidACL``…).

    aiozk's ``Session.send`` logs every such answer at ERROR with a traceback and then raises it to the
    caller anyway, where :meth:`ZkSession.call` turns it into one clear error: a worker with the wrong
    credentials would otherwise print a traceback wall per call.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        refused = record.exc_info is not None and isinstance(record.exc_info[1], aiozk.exc.ResponseError)
        return not (refused and record.msg == "Send exception: %s")


_quiet_refusals = _QuietRefusals()


def _auth_answered(future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        # The server closes the connection after a failed auth; the session reconnects and tries again.
        log.warning("ZooKeeper refused the credentials: %s", type(exc).__name__)


# --- aiozk plumbing ---------------------------------------------------------------------------------------


class _Connection(aiozk.connection.Connection):  # type: ignore[misc]  # aiozk has no type hints
    """aiozk's connection, telling its session when the server closes it instead of waiting for a heartbeat."""

    on_lost: Callable[[_Connection], None] | None = None

    async def read_loop(self) -> None:
        await super().read_loop()
        # aiozk's read loop returns quietly when the server closes the socket, leaving requests pending
        # and the session "connected" until a heartbeat times out (up to a session timeout later).
        if not self.closing:
            if self.pending_count():
                self.abort()
            if self.on_lost is not None:
                self.on_lost(self)


class _Session(aiozk.session.Session):  # type: ignore[misc]  # aiozk has no type hints
    """aiozk's session with a reconnect back-off capped at ``reconnect_max_wait`` (aiozk's grows to 60 s)."""

    reconnect_max_wait = 1.0
    auth: bytes | None = None
    """Digest credentials ``user:password`` to present on every connection."""
    conn: Any
    own_session_ids: set[int]
    retiring: dict[asyncio.Future[Any], Any]

    async def find_server(self, allow_read_only: bool) -> None:
        # aiozk 0.32's find_server, with a short capped back-off and no traceback per refused attempt.
        conn: _Connection | None = None
        delay = 0.05
        while conn is None:
            for host, port in random.sample(self.hosts, len(self.hosts)):
                conn = await self.make_connection(host, port)
                if conn is None:
                    continue
                if conn.start_read_only and not allow_read_only:
                    self._retire(conn)
                    conn = None
                    continue
                log.info("connected to ZooKeeper at %s:%s", host, port)
                break
            if conn is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_wait)
        old_conn, self.conn = self.conn, conn
        if old_conn is not None:
            self._retire(old_conn)

    async def make_connection(self, host: str, port: int) -> _Connection | None:
        conn = _Connection(host, port, watch_handler=self.event_dispatch, read_timeout=self.read_timeout)
        conn.on_lost = self._connection_lost
        try:
            # aiozk's handshake reads the `srvr` answer with no timeout: a server that accepts and stays
            # silent would hang the reconnect for ever.
            await asyncio.wait_for(conn.connect(), conn.read_timeout)
        except Exception as exc:  # as aiozk does: whatever it was, try the next server (or again)
            log.debug("cannot connect to ZooKeeper at %s:%s: %r", host, port, exc)
            with contextlib.suppress(Exception):
                if conn.writer is not None:
                    conn.writer.close()
            return None
        return conn

    async def establish_session(self) -> None:
        await super().establish_session()
        self.own_session_ids.add(int(self.session_id))
        if self.auth is not None:
            # Before the session counts as connected, so before any queued request goes out on this
            # connection: the server handles one connection's packets in order, so everything after this
            # runs as the identity. Not awaited: aiozk starts the read loop only after this returns.
            answer = self.conn.send(_DigestAuth(type=0, scheme="digest", auth=self.auth))
            answer.add_done_callback(_auth_answered)

    def _connection_lost(self, conn: _Connection) -> None:
        if (
            conn is self.conn
            and not self.closing
            and self.state.current_state != aiozk.session.States.SUSPENDED
        ):
            with contextlib.suppress(aiozk.exc.InvalidStateTransition):
                self.state.transition_to(aiozk.session.States.SUSPENDED)

    def _retire(self, conn: Any) -> None:
        """Close a connection we no longer use, in the background (kept so that teardown can finish it)."""
        if not hasattr(self, "retiring"):
            self.retiring = {}
        task = asyncio.ensure_future(conn.close(self.timeout))
        self.retiring[task] = conn
        task.add_done_callback(lambda t: self.retiring.pop(t, None))


async def _abandon(client: Any) -> None:
    """Tear an aiozk client down without the server: cancel its tasks and close its socket."""
    session = client.session
    session.closing = True
    tasks: list[asyncio.Future[Any]] = []
    for task in (session.repair_loop_task, session.heartbeat_task):
        if task is not None and not task.done():
            tasks.append(task)
    if session.heartbeat_handle is not None:
        session.heartbeat_handle.cancel()
        session.heartbeat_handle = None
    retiring: dict[asyncio.Future[Any], Any] = getattr(session, "retiring", {})
    conns = [c for c in (session.conn, *retiring.values()) if c is not None]
    tasks.extend(t for t in retiring if not t.done())
    for conn in conns:
        conn.closing = True
        if conn.read_loop_task is not None and not conn.read_loop_task.done():
            tasks.append(conn.read_loop_task)
        with contextlib.suppress(Exception):
            if conn.pending_count():
                conn.abort()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for conn in conns:
        if conn.writer is not None:
            conn.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
    session.started = False
    session.closing = False


class ZkSession:
    """One aiozk client whose every call has a deadline and whose failures are :class:`CoordinatorUnavailable`.

    Args:
        hosts: ``host:port[,host:port...]``.
        session_timeout: The session timeout to ask for, in seconds (the server clamps it to its
            ``minSessionTimeout``/``maxSessionTimeout``; :attr:`timeout` is what it granted).
        connect_timeout: Seconds :meth:`open` may take.
        op_timeout: Default seconds for one call.
        reconnect_max_wait: Longest pause between reconnect attempts while the server is down.
        auth: Digest credentials ``user:password``, presented on every connection; the nodes this
            session creates get :func:`registry_acl` (see :meth:`ensure_path` for the ancestors).
            None: no credentials, and nodes open to anyone.
        world_read: With ``auth``, let anyone read the nodes created.
    """

    def __init__(
        self,
        hosts: str,
        *,
        session_timeout: float,
        connect_timeout: float,
        op_timeout: float,
        reconnect_max_wait: float = 1.0,
        auth: str | None = None,
        world_read: bool = True,
    ) -> None:
        self.hosts = hosts
        self.session_timeout = session_timeout
        self.connect_timeout = connect_timeout
        self.op_timeout = op_timeout
        self.reconnect_max_wait = reconnect_max_wait
        self._auth = None if auth is None else check_auth(auth).encode()
        self.acl = registry_acl(auth, world_read=world_read)
        """The ACL of the nodes this session creates."""
        self.shared_acl = shared_acl(auth)
        """The ACL of the ancestors :meth:`ensure_path` creates above its ``shared`` path."""
        self._client: Any = None
        self._own_session_ids: set[int] = set()

    def __repr__(self) -> str:
        return f"ZkSession({self.hosts!r}, session_id={self.session_id})"

    @property
    def session_id(self) -> int | None:
        """The current ZooKeeper session ID (changes when aiozk replaces an expired session)."""
        if self._client is None:
            return None
        sid = self._client.session.session_id
        return int(sid) if sid else None

    @property
    def own_session_ids(self) -> frozenset[int]:
        """Every session ID this object has established (an old one may outlive aiozk's interest in it)."""
        return frozenset(self._own_session_ids)

    @property
    def password(self) -> bytes:
        """The session password (tests use it to expire the session from a second connection)."""
        if self._client is None:
            return b""
        return bytes(self._client.session.password)

    @property
    def timeout(self) -> float:
        """The negotiated session timeout in seconds (the requested one before the first connection)."""
        if self._client is None:
            return self.session_timeout
        return float(self._client.session.timeout)

    async def open(self) -> None:
        """Connect and establish a session; a no-op when already open.

        Raises:
            CoordinatorUnavailable: no session within ``connect_timeout`` seconds.
        """
        if self._client is not None:
            return
        logging.getLogger("aiozk.session").addFilter(_quiet_refusals)  # once: filters are a set
        client = aiozk.ZKClient(self.hosts, session_timeout=self.session_timeout, default_acl=self.acl)
        session = _Session(
            self.hosts, self.session_timeout, aiozk.RetryPolicy.forever(), False, min(3.0, self.op_timeout)
        )
        session.reconnect_max_wait = self.reconnect_max_wait
        session.auth = self._auth
        session.own_session_ids = self._own_session_ids
        client.session = session
        try:
            await asyncio.wait_for(client.start(), self.connect_timeout)
        except BaseException as exc:
            await _abandon(client)
            if isinstance(exc, TimeoutError | OSError | aiozk.exc.ZKError):
                raise CoordinatorUnavailable(
                    f"no ZooKeeper session with {self.hosts} within {self.connect_timeout:g} s"
                ) from exc
            raise
        self._client = client
        log.info(
            "ZooKeeper session %#x with %s (timeout %.1f s)", self.session_id or 0, self.hosts, self.timeout
        )

    async def call(
        self, action: str, request: Callable[[Any], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run ``request(client)`` with a deadline.

        ``NoNode``, ``NodeExists``, ``BadVersion`` and ``NotEmpty`` pass through for the caller to handle;
        every other failure, and the deadline, become :class:`CoordinatorUnavailable`.

        Args:
            action: What is being done, for the message ("listing workers").
            request: Builds the aiozk call from the client.
            timeout: Seconds; ``op_timeout`` when omitted.
        """
        if self._client is None:
            raise CoordinatorUnavailable(f"{action}: no ZooKeeper session (not opened, or closed)")
        limit = self.op_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(request(self._client), limit)
        except (aiozk.exc.NoNode, aiozk.exc.NodeExists, aiozk.exc.BadVersion, aiozk.exc.NotEmpty):
            raise
        except TimeoutError as exc:
            raise CoordinatorUnavailable(f"{action} ({self.hosts}): no answer within {limit:g} s") from exc
        except aiozk.exc.NoAuth as exc:
            who = "these credentials" if self._auth is not None else "a client without credentials"
            raise CoordinatorUnavailable(
                f"{action} ({self.hosts}): the node's ACL does not allow {who} (NoAuth); "
                "check snowflake.zookeeper_auth"
            ) from exc
        except (aiozk.exc.ZKError, OSError) as exc:
            raise CoordinatorUnavailable(f"{action} ({self.hosts}): {type(exc).__name__}: {exc}") from exc

    async def ensure_path(self, path: str, *, shared: str = "") -> None:
        """Create ``path`` and its parents as persistent nodes where missing (never containers).

        Nodes down to ``shared`` (the parent of the registry namespaces, used by other identities too)
        get :attr:`shared_acl`, the ones below it :attr:`acl`. Existing nodes keep their ACL.
        """
        parts = [p for p in path.split("/") if p]
        shared_depth = len([p for p in shared.split("/") if p])
        for i in range(1, len(parts) + 1):
            node = "/" + "/".join(parts[:i])
            acl = self.shared_acl if i <= shared_depth else self.acl
            with contextlib.suppress(aiozk.exc.NodeExists):
                await self.call(f"creating {node}", _creator(node, acl))

    async def restrict(self, path: str) -> None:
        """Give ``path`` :attr:`acl` if it has another ACL (e.g. it was created before credentials were set).

        A no-op without credentials. Needs ADMIN permission on the node (anyone has it on an open node);
        without it, the node is left as it is with a warning.
        """
        if self._auth is None:
            return
        try:
            current = await self.call(f"reading the ACL of {path}", lambda zk: zk.get_acl(path))
        except aiozk.exc.NoNode:
            return
        if _acl_set(current) == _acl_set(self.acl):
            return
        try:
            await self.call(f"restricting {path}", lambda zk: zk.set_acl(path, self.acl, force=True))
        except aiozk.exc.NoNode:
            return
        except CoordinatorUnavailable as exc:
            if not isinstance(exc.__cause__, aiozk.exc.NoAuth):
                raise
            log.warning("%s has an ACL of another identity; left as it is", path)
            return
        log.warning(
            "%s had another ACL (%s); restricted it to the configured identity", path, _describe(current)
        )

    async def get(self, path: str) -> tuple[bytes | None, Any] | None:
        """Return ``(data, stat)`` of a node, or None when it does not exist."""
        try:
            data, stat = await self.call(f"reading {path}", lambda zk: zk.get(path))
        except aiozk.exc.NoNode:
            return None
        return data, stat

    async def children(self, path: str) -> list[str]:
        """Return the child names of ``path`` (empty if it does not exist)."""
        try:
            names = await self.call(f"listing {path}", lambda zk: zk.get_children(path))
        except aiozk.exc.NoNode:
            return []
        return [str(n) for n in names]

    async def raise_timestamp(self, path: str, address: str, timestamp: int, *, create: bool) -> int:
        """Make the node's timestamp ``max(current, timestamp)`` with a compare-and-set; return the result.

        The node is a max register: concurrent or late writers (a worker that lost its lease) can only
        raise it, never lower it.

        Args:
            path: The node.
            address: The writer, recorded with the timestamp.
            timestamp: Unix ms.
            create: Create the node when missing; otherwise a missing node raises ``aiozk.exc.NoNode``.
        """
        for _ in range(_CAS_ATTEMPTS):
            found = await self.get(path)
            if found is None:
                if not create:
                    raise aiozk.exc.NoNode()
                try:
                    await self.call(
                        f"creating {path}", lambda zk: zk.create(path, data=encode_node(address, timestamp))
                    )
                except aiozk.exc.NodeExists:
                    continue
                return timestamp
            data, stat = found
            value = max(decode_node(data, path).timestamp, timestamp)
            try:
                await self.call(f"writing {path}", _setter(path, encode_node(address, value), stat.version))
            except aiozk.exc.BadVersion:
                continue
            return value
        raise CoordinatorUnavailable(f"writing {path}: {_CAS_ATTEMPTS} concurrent updates in a row")

    async def abandon(self) -> None:
        """Drop the connection without closing the session, as a crash would; for tests.

        The session's ephemeral nodes stay until the server expires it.
        """
        client, self._client = self._client, None
        if client is not None:
            await _abandon(client)

    async def close(self) -> None:
        """Close the session (its ephemeral nodes go with it); bounded even when the server is gone."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            await asyncio.wait_for(client.close(), self.op_timeout)
        except (TimeoutError, OSError, aiozk.exc.ZKError, aiozk.exc.InvalidStateTransition) as exc:
            log.info("ZooKeeper session with %s not closed cleanly (%r); abandoning it", self.hosts, exc)
        # aiozk's close leaves tasks and the socket behind when it fails, and its cancelled repair loop
        # behind even when it succeeds.
        await _abandon(client)


def _acl_set(acl: list[Any]) -> set[tuple[str, str, int]]:
    return {(a.id.scheme, a.id.id, int(a.perms)) for a in acl}


def _describe(acl: list[Any]) -> str:
    # Schemes and permissions only: a digest ID is a hash of its password.
    return ", ".join(
        f"{a.id.scheme}:{'anyone' if a.id.scheme == 'world' else '…'}={int(a.perms)}" for a in acl
    )


def _creator(path: str, acl: list[Any]) -> Callable[[Any], Awaitable[Any]]:
    return lambda zk: zk.create(path, acl=acl)


def _setter(path: str, data: bytes, version: int) -> Callable[[Any], Awaitable[Any]]:
    return lambda zk: zk.set(path, data, version)


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
    ) -> None:
        if max_worker_id < 0:
            raise ValueError(f"max_worker_id must be at least 0, got {max_worker_id}")
        self.name = check_name(name)
        self.address = check_address(address)
        self.max_worker_id = max_worker_id
        self.root_path = "/" + "/".join(p for p in root.split("/") if p)
        self.base_path = "/" + "/".join(p for p in (*root.split("/"), name) if p)
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
    """

    mode = "zookeeper"
    _HOME = "forever"
    _node: str | None = None  # our node under forever/, once registered
    _session_id: int | None = None  # the session holding our temporary node

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
                    raise CoordinatorUnavailable(f"worker node {node} vanished while registering; try again")
                recorded = decode_node(found[0], node).timestamp
                if worker_id > self.max_worker_id:
                    raise WorkerIdOutOfRange(worker_id, self.max_worker_id)
                await self._zk.restrict(node)
            else:
                created = await self._zk.call(
                    "creating the worker node",
                    lambda zk: zk.create(
                        f"{self.forever_path}/{self.address}-",
                        data=encode_node(self.address, self._clock.wall_ms()),
                        sequential=True,
                    ),
                )
                node = str(created)
                parsed = parse_worker_node(node.rpartition("/")[2])
                if parsed is None:
                    raise CoordinatorUnavailable(f"ZooKeeper created an unexpected node {node}")
                worker_id = parsed[1]
                recorded = 0
                if worker_id > self.max_worker_id:
                    # Useless to anyone (sequence numbers only grow); don't leave it to look like a worker.
                    with contextlib.suppress(aiozk.exc.NoNode, CoordinatorUnavailable):
                        await self._zk.call(f"deleting {node}", lambda zk: zk.delete(node, force=True))
                    raise WorkerIdsExhausted(self.max_worker_id + 1, self._where)
                log.info("%s: new worker node %s", self, node)
            await self._hold_temporary(wait=True)
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
            with contextlib.suppress(aiozk.exc.NodeExists):
                await self._zk.call(f"creating {path}", lambda zk: zk.create(path, data=data, ephemeral=True))
            found = await self._zk.get(path)
            if found is None:
                continue  # it went away in between
            owner = int(found[1].ephemeral_owner)
            if owner == self._zk.session_id:
                self._session_id = owner
                return
            if owner in self._zk.own_session_ids:
                # An earlier session of ours that aiozk gave up on but the server has not expired yet.
                with contextlib.suppress(aiozk.exc.NoNode):
                    await self._zk.call(f"deleting {path}", lambda zk: zk.delete(path, force=True))
                continue
            if time.monotonic() >= deadline:
                raise WorkerAddressInUse(self.address, self._where)
            await asyncio.sleep(0.1)

    async def report(self, high_water_ms: int) -> None:
        """Raise the worker node's timestamp to ``high_water_ms``; restore the ephemeral node if needed.

        Raises:
            CoordinatorUnavailable: not registered yet, or ZooKeeper did not answer in time (the worker
                keeps issuing; call again on the next tick).
            LeaseLost: the worker node was deleted, or another live worker took this address.
        """
        if self._worker_id is None or self._node is None:
            raise CoordinatorUnavailable(f"{self}: not registered (register() has not succeeded yet)")
        if self._lost is not None:
            raise LeaseLost(self._worker_id, self._lost)
        self._reported = max(self._reported, high_water_ms)
        async with self._lock:
            if self._zk.session_id != self._session_id:
                log.info(
                    "%s: new ZooKeeper session; holding %s/%s again", self, self.temporary_path, self.address
                )
                try:
                    await self._hold_temporary(wait=False)
                except WorkerAddressInUse as exc:
                    self._lost = exc.message
                    raise LeaseLost(self._worker_id, exc.message) from None
            try:
                await self._zk.raise_timestamp(self._node, self.address, self._reported, create=False)
            except aiozk.exc.NoNode:
                self._lost = f"its node {self._node} was deleted"
                raise LeaseLost(self._worker_id, self._lost) from None

    def can_issue(self) -> bool:
        """True once registered, even while ZooKeeper is down: the ID belongs to this address for good."""
        return self._worker_id is not None and self._lost is None

    async def close(self) -> None:
        """Close the session, which removes the ephemeral node; the worker node stays for the next run."""
        async with self._lock:
            self._worker_id = None
            self._node = None
            await self._zk.close()
