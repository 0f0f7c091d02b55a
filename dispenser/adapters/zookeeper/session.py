"""The ZooKeeper session both registries share: one kazoo client, every call under a deadline.

Failures other than the node answers a registry handles (:data:`NoNode`, :data:`NodeExists`,
:data:`BadVersion`, :data:`NotEmpty`) become :class:`~dispenser.core.errors.CoordinatorUnavailable` with one
clear line: its ``message`` (what a caller may be answered) says what failed, never where; the hosts and the
node's path are in ``str(error)``, for the log and the operator. Why kazoo, the threads, the deadlines and the negotiated timeout: docs/snowflake.md ("The
ZooKeeper client"). The parts live beside this module: :mod:`.acl`, :mod:`.bridge`, :mod:`.handler`,
:mod:`.handshake`, :mod:`.kazoo_log`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import kazoo.client  # type: ignore[import-untyped]  # kazoo has no type hints
import kazoo.exceptions  # type: ignore[import-untyped]
import kazoo.retry  # type: ignore[import-untyped]

from dispenser.adapters.zookeeper.acl import acl_set, check_auth, describe_acl, registry_acl, shared_acl
from dispenser.adapters.zookeeper.bridge import answer, in_thread
from dispenser.adapters.zookeeper.handler import BoundedHandler
from dispenser.adapters.zookeeper.handshake import negotiated_timeout
from dispenser.adapters.zookeeper.kazoo_log import KAZOO_LOG
from dispenser.core.errors import CoordinatorUnavailable

__all__ = [
    "BadVersion",
    "NoNode",
    "NodeExists",
    "NodeStat",
    "NotEmpty",
    "ZkSession",
]

log = logging.getLogger(__name__)

# The node answers a registry handles itself; they pass through ZkSession.call unchanged.
NoNode: type[Exception] = kazoo.exceptions.NoNodeError
"""The node does not exist."""
NodeExists: type[Exception] = kazoo.exceptions.NodeExistsError
"""The node exists already."""
BadVersion: type[Exception] = kazoo.exceptions.BadVersionError
"""The node changed since it was read (compare-and-set lost)."""
NotEmpty: type[Exception] = kazoo.exceptions.NotEmptyError
"""The node has children."""

_PASSED_THROUGH = (NoNode, NodeExists, BadVersion, NotEmpty)


class NodeStat(NamedTuple):
    """What the registries read from a node's stat."""

    version: int
    """The data version (for compare-and-set)."""
    ephemeral_owner: int
    """The session that owns the node if it is ephemeral, else 0."""
    mtime: int = 0
    """When the node was last written, Unix ms by ZooKeeper's clock (the leader's when it wrote)."""


class ZkSession:
    """One kazoo client whose every call has a deadline and whose failures are :class:`CoordinatorUnavailable`.

    Args:
        hosts: ``host:port[,host:port...]``.
        session_timeout: The session timeout to ask for, in seconds (the server clamps it to its
            ``minSessionTimeout``/``maxSessionTimeout``; :attr:`timeout` is what it granted).
        connect_timeout: Seconds :meth:`open` may take.
        op_timeout: Default seconds for one call (waiting for a connection included).
        reconnect_max_wait: Longest pause between reconnect attempts while the server is down.
        auth: Digest credentials ``user:password``, presented on every connection; the nodes this
            session creates get :func:`registry_acl` (see :meth:`ensure_path` for the ancestors).
            None: no credentials, and nodes open to anyone.
        world_read: With ``auth``, let anyone read the nodes created.

    :attr:`session_id` is kept while the connection is down (the session may live on) and cleared only when
    ZooKeeper says the session is gone; kazoo then starts a new one by itself, so the registries compare
    session IDs to notice that their ephemeral nodes went. It is updated in kazoo's thread *before* kazoo
    sends anything on the new session, so a request answered while it still reads the old value was sent on
    the old session (the lease registry's safety argument needs this).
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
        self._auth = None if auth is None else check_auth(auth)
        self.acl = registry_acl(auth, world_read=world_read)
        """The ACL of the nodes this session creates."""
        self.shared_acl = shared_acl(auth)
        """The ACL of the ancestors :meth:`ensure_path` creates above its ``shared`` path."""
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = asyncio.Event()
        self._granted: float | None = None
        # Written in kazoo's connection thread (see _on_state), read on the loop.
        self._ids = threading.Lock()
        self._session_id: int | None = None
        self._password = b""
        self._own_session_ids: set[int] = set()

    def __repr__(self) -> str:
        return f"ZkSession({self.hosts!r}, session_id={self.session_id})"

    @property
    def session_id(self) -> int | None:
        """The current ZooKeeper session ID: kept while disconnected, new when kazoo replaced an expired one."""
        return self._session_id

    @property
    def own_session_ids(self) -> frozenset[int]:
        """Every session ID this object has established (an old one may outlive our interest in it)."""
        with self._ids:
            return frozenset(self._own_session_ids)

    @property
    def password(self) -> bytes:
        """The session password (tests use it to expire the session from a second connection)."""
        return self._password

    @property
    def timeout(self) -> float:
        """The negotiated session timeout in seconds (the requested one before the first connection)."""
        return self.session_timeout if self._granted is None else self._granted

    @property
    def connected(self) -> bool:
        """True while the client has a live connection."""
        return self._client is not None and bool(self._client.connected)

    def _on_state(self, client: Any, state: Any) -> bool:
        """The kazoo state listener, called in its connection thread; must not block."""
        if client is not self._client:
            return True  # a client we dropped: stop listening
        if state == kazoo.client.KazooState.CONNECTED:
            found = client.client_id
            if found is not None:
                with self._ids:
                    self._session_id, self._password = int(found[0]), bytes(found[1])
                    self._own_session_ids.add(self._session_id)
        elif state == kazoo.client.KazooState.LOST:
            self._session_id = None
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(
                    self._set_connected, client, state == kazoo.client.KazooState.CONNECTED
                )
        return False

    def _set_connected(self, client: Any, connected: bool) -> None:
        if client is not self._client:
            return
        if connected and client.connected:
            self._connected.set()
        elif not connected:
            self._connected.clear()

    async def open(self) -> None:
        """Connect and establish a session; a no-op when already open.

        Raises:
            CoordinatorUnavailable: no session within ``connect_timeout`` seconds.
        """
        if self._client is not None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        failed = functools.partial(
            CoordinatorUnavailable,
            f"no ZooKeeper session within {self.connect_timeout:g} s; details in the worker's log",
            logged=f"no ZooKeeper session with {self.hosts} within {self.connect_timeout:g} s",
        )
        try:
            granted = await negotiated_timeout(self.hosts, self.session_timeout, self.connect_timeout)
        except OSError as exc:
            raise failed() from exc
        client = kazoo.client.KazooClient(
            hosts=self.hosts,
            timeout=self.session_timeout,
            # Retry for ever, starting fast: the default back-off grows to a minute, and a worker should be
            # back within a second of ZooKeeper.
            connection_retry=kazoo.retry.KazooRetry(
                max_tries=-1,
                delay=0.05,
                backoff=2,
                max_jitter=0.2,
                max_delay=self.reconnect_max_wait,
                sleep_func=BoundedHandler.sleep_func,
            ),
            command_retry=None,  # our deadlines decide; a retried write could land twice
            auth_data=None if self._auth is None else [("digest", self._auth)],
            default_acl=self.acl,
            read_only=False,
            logger=KAZOO_LOG,
            # The old aiozk wrapper's bound on a handshake read: long enough for a loaded server. Silent
            # for T/2: the server is dropped, and the session reaches another one before a lease unconfirmed
            # since then stops issuing (2/3 T). ZooKeeper's Java client waits 2/3 T ("have not heard from
            # server"); a live server is heard at least every T/3 (kazoo pings after T/3 without sending).
            handler=BoundedHandler(min(3.0, self.op_timeout), silence_limit=granted / 2),
        )
        self._loop = loop
        self._connected = asyncio.Event()  # of this loop (an Event binds to the first loop that waits on it)
        self._client = client
        client.add_listener(functools.partial(self._on_state, client))
        try:
            await in_thread(client.start_async, "kazoo start")
            await asyncio.wait_for(self._connected.wait(), max(0.0, deadline - loop.time()))
        except BaseException as exc:
            self._client = None
            self._discard(client)
            if isinstance(exc, TimeoutError | OSError | kazoo.exceptions.KazooException):
                raise failed() from exc
            raise
        self._granted = granted
        log.info(
            "ZooKeeper session %#x with %s (timeout %.1f s)", self.session_id or 0, self.hosts, self.timeout
        )

    async def call(
        self, action: str, request: Callable[[Any], Any], timeout: float | None = None, *, node: str = ""
    ) -> Any:
        """Run ``request(client)`` (a kazoo ``*_async`` call) with a deadline and return its value.

        :data:`NoNode`, :data:`NodeExists`, :data:`BadVersion` and :data:`NotEmpty` pass through for the
        caller to handle; every other failure, and the deadline, become :class:`CoordinatorUnavailable`,
        whose ``message`` names ``action`` and what went wrong (kazoo's exception class), and whose
        ``str()`` adds the node and the hosts, and kazoo's words.

        Args:
            action: What is being done, for the message ("writing a node"): no path, no host.
            request: Starts the kazoo call on the client and returns its ``IAsyncResult``.
            timeout: Seconds, waiting for a connection included; ``op_timeout`` when omitted.
            node: The node's path, for the log's version of the message.
        """
        where = f"{node} on {self.hosts}" if node else self.hosts
        client = self._client
        if client is None:
            raise CoordinatorUnavailable(
                f"{action}: no ZooKeeper session (not opened, or closed)",
                logged=f"{action} ({where}): no ZooKeeper session (not opened, or closed)",
            )
        limit = self.op_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await self._connected.wait()
                return await answer(request(client))
        except _PASSED_THROUGH:
            raise
        except TimeoutError as exc:
            raise CoordinatorUnavailable(
                f"{action}: no answer within {limit:g} s; details in the worker's log",
                logged=f"{action} ({where}): no answer within {limit:g} s",
            ) from exc
        except kazoo.exceptions.NoAuthError as exc:
            who = "these credentials" if self._auth is not None else "a client without credentials"
            refused = f"the node's ACL does not allow {who} (NoAuth); check snowflake.zookeeper_auth"
            raise CoordinatorUnavailable(
                f"{action}: {refused}", logged=f"{action} ({where}): {refused}"
            ) from exc
        except (kazoo.exceptions.KazooException, OSError) as exc:
            raise CoordinatorUnavailable(
                f"{action}: {type(exc).__name__}; details in the worker's log",
                logged=f"{action} ({where}): {type(exc).__name__}: {exc}",
            ) from exc

    # --- node operations ----------------------------------------------------------------------------------

    async def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        acl: list[Any] | None = None,
        ephemeral: bool = False,
        sequential: bool = False,
    ) -> str:
        """Create a node (with :attr:`acl` unless told otherwise) and return its path (with the sequence)."""
        created = await self.call(
            "creating a node",
            lambda zk: zk.create_async(
                path, data, acl=self.acl if acl is None else acl, ephemeral=ephemeral, sequence=sequential
            ),
            node=path,
        )
        return str(created)

    async def delete(self, path: str) -> None:
        """Delete a node whatever its version."""
        await self.call("deleting a node", lambda zk: zk.delete_async(path), node=path)

    async def get(self, path: str) -> tuple[bytes, NodeStat] | None:
        """Return ``(data, stat)`` of a node, or None when it does not exist."""
        try:
            data, stat = await self.call("reading a node", lambda zk: zk.get_async(path), node=path)
        except NoNode:
            return None
        owner = int(stat.ephemeralOwner)
        return bytes(data or b""), NodeStat(
            version=int(stat.version), ephemeral_owner=owner, mtime=int(stat.mtime)
        )

    async def set(self, path: str, data: bytes, version: int) -> None:
        """Write a node's data if its version is still ``version`` (else :data:`BadVersion`)."""
        await self.call("writing a node", lambda zk: zk.set_async(path, data, version), node=path)

    async def children(self, path: str) -> list[str]:
        """Return the child names of ``path`` (empty if it does not exist)."""
        try:
            names = await self.call(
                "listing a node's children", lambda zk: zk.get_children_async(path), node=path
            )
        except NoNode:
            return []
        return [str(n) for n in names]

    async def get_acl(self, path: str) -> list[Any]:
        """Return a node's ACL (kazoo ``ACL`` entries: ``perms``, ``id.scheme``, ``id.id``)."""
        acl, _ = await self.call("reading a node's ACL", lambda zk: zk.get_acls_async(path), node=path)
        return list(acl)

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
            with contextlib.suppress(NodeExists):
                await self.create(node, acl=acl)

    async def restrict(self, path: str) -> None:
        """Give ``path`` :attr:`acl` if it has another ACL (e.g. it was created before credentials were set).

        A no-op without credentials. Needs ADMIN permission on the node (anyone has it on an open node);
        without it, the node is left as it is with a warning.
        """
        if self._auth is None:
            return
        try:
            current = await self.get_acl(path)
        except NoNode:
            return
        if acl_set(current) == acl_set(self.acl):
            return
        try:
            await self.call(
                "restricting a node's ACL", lambda zk: zk.set_acls_async(path, self.acl), node=path
            )
        except NoNode:
            return
        except CoordinatorUnavailable as exc:
            if not isinstance(exc.__cause__, kazoo.exceptions.NoAuthError):
                raise
            log.warning("%s has an ACL of another identity; left as it is", path)
            return
        log.warning(
            "%s had another ACL (%s); restricted it to the configured identity", path, describe_acl(current)
        )

    # --- closing ------------------------------------------------------------------------------------------

    def _discard(self, client: Any) -> None:
        """Stop a client in the background (kazoo's stop may wait for a connection attempt to time out)."""

        def stop() -> None:
            client.stop()
            client.close()

        task = in_thread(stop, "kazoo stop")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it: don't warn

    async def close(self) -> None:
        """Close the session (its ephemeral nodes go with it); bounded by ``op_timeout`` with the server gone."""
        client, self._client = self._client, None
        self._connected.clear()
        self._session_id = None
        if client is None:
            return

        def stop() -> None:
            client.stop()
            client.close()

        try:
            await asyncio.wait_for(in_thread(stop, "kazoo stop"), self.op_timeout)
        except (TimeoutError, OSError, kazoo.exceptions.KazooException) as exc:
            # The daemon thread finishes the stop by itself; the server expires the session meanwhile.
            log.info("ZooKeeper session with %s not closed cleanly (%r); left to expire", self.hosts, exc)
