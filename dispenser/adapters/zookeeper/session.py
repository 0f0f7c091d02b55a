"""The ZooKeeper session both registries share: connection, digest credentials, ACLs, deadlines, errors.

Built on **kazoo**, through its public API only (``KazooClient`` and its ``*_async`` calls, ``add_listener``,
``KazooState``, ``KazooRetry``, the handler interface, ``kazoo.security``, ``kazoo.exceptions``); the names
and behaviours relied on are pinned by ``tests/unit/test_kazoo_contract.py`` and the dependency's upper
bound.

**Why kazoo, not aiozk.** aiozk 0.32 made us subclass its ``Connection`` and ``Session`` and drive their
internals (``repair_loop_task``, ``heartbeat_handle``, ``read_loop_task``, ``find_server``…), since its public
API had no way to: present digest credentials on every connection (no ``add_auth``; ZooKeeper keeps
credentials per connection, so a reconnect would come back as nobody), cap the reconnect back-off (hard-wired
to grow to 60 s), bound the handshake read (none), notice a connection the server closed before the next
heartbeat, or close without the server (``close()`` raised and left tasks behind). Any rename upstream
would have silently broken session-loss detection. kazoo has all of it as public, documented API:
``auth_data`` re-sent on every connection before any queued request, ``connection_retry`` with a
``max_delay``, deadlines on the handshake and pings, state listeners, ACLs, and a ``stop()`` that works
with the server gone. One gap remains: kazoo waits up to a whole session timeout for a handshake answer,
and ZooKeeper may leave a connection made while it starts neither answered nor closed; the handler we give
kazoo (:class:`_BoundedHandler`) caps every socket wait at ``min(3 s, op_timeout)``, as the aiozk wrapper
did.

**Threads.** kazoo is synchronous: it runs its own connection thread, and its ``*_async`` calls return a
result that we hand to the event loop with ``call_soon_threadsafe`` (no thread per call; kazoo's threads
only ever touch the loop through that). Registry calls are seconds apart (the lease keepalive makes one
every ``T/6``), so the hop costs nothing that matters: measured on loopback, a read through
:meth:`ZkSession.get` takes 0.44-0.49 ms median and 5-8 ms at p99, against 0.33-0.44 ms and 1.8-2.4 ms for
aiozk's ``get`` (two runs of 500 reads each), and :meth:`ZkSession.open` 26-30 ms, the timeout probe
included.

**Deadlines and errors.** A client waits for the server for ever while it is down, so every call here runs
under a deadline (``op_timeout``), and it and every failure other than the expected node answers
(:data:`NoNode`, :data:`NodeExists`, :data:`BadVersion`, :data:`NotEmpty`) become
:class:`~dispenser.core.errors.CoordinatorUnavailable` with one clear line (``NoAuth`` names the setting to
check, never the credentials). Calls wait for a connection before they are queued, so a request is not
left in kazoo's queue to go out long after its caller gave up.

**Sessions.** :attr:`ZkSession.session_id` is the session the client is on, kept while the connection is
down (the session may live on) and cleared only when ZooKeeper says it is gone; kazoo then starts a *new*
session by itself, so the registries compare session IDs to notice that their ephemeral nodes went. The id
is updated in kazoo's thread *before* kazoo sends anything on the new session, so a request answered while
:attr:`~ZkSession.session_id` still reads the old value was sent on the old session (the lease registry's
safety argument needs this).

**The negotiated session timeout.** The server may grant a shorter timeout than asked for (its
``maxSessionTimeout``), and the lease registry must time itself by the grant, not the request. kazoo keeps
the grant to itself, so :meth:`ZkSession.open` asks each server once with a throw-away handshake (a connect
request and a close, 60 bytes) and takes the smallest grant; the servers of an ensemble share these limits.

**Credentials and ACLs** (``snowflake.zookeeper_auth = "user:password"``): the client presents them on every
connection (kazoo's ``auth_data``), and every node a registry creates from the namespace ``<root>/<name>``
down carries :func:`registry_acl`: all permissions for that identity, and read for anyone if asked. So a
client without the credentials cannot create, overwrite or delete worker registrations. The shared
ancestors (``/leaf``, ``/leaf/snowflake``) get :func:`shared_acl`, which lets other identities create their
own namespaces there. Nodes that already exist keep the ACL they were created with (see
:meth:`ZkSession.restrict`). kazoo logs every request it sends at DEBUG, the credentials included; its log
records go through a filter here that prints requests by type and path only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import struct
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import kazoo.client  # type: ignore[import-untyped]  # kazoo has no type hints
import kazoo.exceptions  # type: ignore[import-untyped]
import kazoo.handlers.threading  # type: ignore[import-untyped]
import kazoo.retry  # type: ignore[import-untyped]
import kazoo.security  # type: ignore[import-untyped]

from dispenser.core.errors import CoordinatorUnavailable

__all__ = [
    "BadVersion",
    "NoNode",
    "NodeExists",
    "NodeStat",
    "NotEmpty",
    "ZkSession",
    "check_auth",
    "digest_id",
    "registry_acl",
    "shared_acl",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

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
_DEFAULT_PORT = 2181


class NodeStat(NamedTuple):
    """What the registries read from a node's stat."""

    version: int
    """The data version (for compare-and-set)."""
    ephemeral_owner: int
    """The session that owns the node if it is ephemeral, else 0."""


# --- credentials and ACLs ---------------------------------------------------------------------------------


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
        auth: ``user:password``; None: no credentials, so the nodes are open to anyone.
        world_read: Let anyone read the nodes and list their children (``world:anyone`` READ).
    """
    if auth is None:
        return list(kazoo.security.OPEN_ACL_UNSAFE)
    acl = [_digest_all(auth)]
    if world_read:
        acl.append(kazoo.security.make_acl("world", "anyone", read=True))
    return acl


def shared_acl(auth: str | None) -> list[Any]:
    """The ACL of the ancestors a registry creates above its namespace (``/leaf``, ``/leaf/snowflake``).

    Anyone may read them and create children (other teams' namespaces, with other credentials); only
    ``auth``'s identity may change, delete under or re-ACL them.
    """
    if auth is None:
        return list(kazoo.security.OPEN_ACL_UNSAFE)
    return [_digest_all(auth), kazoo.security.make_acl("world", "anyone", read=True, create=True)]


def _digest_all(auth: str) -> Any:
    return kazoo.security.make_acl("digest", digest_id(auth), all=True)


def _acl_set(acl: list[Any]) -> set[tuple[str, str, int]]:
    return {(a.id.scheme, a.id.id, int(a.perms)) for a in acl}


def _describe(acl: list[Any]) -> str:
    # Schemes and permissions only: a digest ID is a hash of its password.
    return ", ".join(
        f"{a.id.scheme}:{'anyone' if a.id.scheme == 'world' else '…'}={int(a.perms)}" for a in acl
    )


# --- kazoo's log --------------------------------------------------------------------------------------------


def _summary(arg: Any) -> Any:
    """A kazoo request or response (a namedtuple of ``kazoo.*``, or a tuple or list of them) by type and path."""
    kind = type(arg)
    if isinstance(arg, tuple) and hasattr(kind, "_fields") and kind.__module__.startswith("kazoo."):
        path = getattr(arg, "path", None)
        return f"{kind.__name__}(path={path!r})" if path is not None else f"{kind.__name__}(…)"
    if kind in (tuple, list):  # a response such as (ACLs, stat): its parts
        return kind(_summary(a) for a in arg)
    return arg


class _Redact(logging.Filter):
    """Print kazoo's requests by type and path only.

    Its DEBUG line ``Sending request(xid=…): …`` shows whole requests: the digest credentials (``Auth``),
    the session password (``Connect``) and ACLs included.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            args = tuple(_summary(a) for a in record.args)
            if "session_passwd" in str(record.msg) and len(args) > 1:
                args = (args[0], "***", *args[2:])  # the session password lets anyone take the session over
            record.args = args
        return True


_KAZOO_LOG = logging.getLogger(f"{__name__}.kazoo")
"""The logger kazoo is given (not its own ``kazoo.client``), so that the filter sees every record it logs."""
_KAZOO_LOG.addFilter(_Redact())


# --- the bridge between kazoo's threads and the event loop ------------------------------------------------


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the caller gave up (deadline) meanwhile
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _answer(result: Any) -> asyncio.Future[Any]:
    """An asyncio future settled with a kazoo ``IAsyncResult``'s value or exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def done(result: Any) -> None:  # in kazoo's callback thread
        try:
            value, error = result.get_nowait(), None
        except Exception as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle, future, value, error)

    result.rawlink(done)
    return future


def _in_thread(work: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run a blocking kazoo call (start, stop) in a daemon thread.

    Not ``asyncio.to_thread``: the default executor's threads are joined at interpreter exit, and ``stop()``
    with the server gone may take up to a session timeout; a daemon thread never holds up exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            value, error = work(), None
        except Exception as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, value, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


# --- socket waits ------------------------------------------------------------------------------------------


_NEVER_SET = threading.Event()
"""Waited on (with a timeout) by :attr:`_BoundedHandler.sleep_func`; never set."""


class _BoundedHandler(kazoo.handlers.threading.SequentialThreadingHandler):  # type: ignore[misc]  # untyped
    """kazoo's default handler, with every wait on a socket capped at ``io_timeout`` seconds.

    kazoo waits for a handshake answer (and for a TCP connect) up to the whole session timeout. ZooKeeper
    accepts connections a moment before it serves, and one that arrives then may be neither answered nor
    closed (measured: a 10 s stall after a restart, long enough for the session to expire). With the cap,
    the attempt times out and kazoo tries again. ``select`` and ``create_connection`` are the handler
    interface (``kazoo.interfaces.IHandler``) that kazoo's connection does all its socket waiting through;
    the ``handler`` argument of ``KazooClient`` is how kazoo lets a user supply one.

    The connection loop also waits here between pings, so an unanswered ping drops the connection after
    ``io_timeout`` (at most; kazoo's own limit is a third of the session timeout).
    """

    # kazoo's reconnect loop sleeps through the handler's sleep_func (its retry must use the same one).
    # time.sleep is clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) on Linux, which libfaketime (the
    # soak's clock faults) answers with EINVAL: the exception killed kazoo's connection thread, and the
    # worker never reconnected. A timed wait on an event that is never set sleeps the same, anywhere.
    sleep_func = staticmethod(_NEVER_SET.wait)

    def __init__(self, io_timeout: float) -> None:
        super().__init__()
        self.io_timeout = io_timeout

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
        limit = self.io_timeout if timeout is None else min(timeout, self.io_timeout)
        return super().select(rlist, wlist, xlist, limit)

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] = min(kwargs["timeout"], self.io_timeout)
        return super().create_connection(*args, **kwargs)


# --- the negotiated timeout -------------------------------------------------------------------------------

_INT = struct.Struct("!i")
# Protocol version, last zxid seen, timeout ms, session id, password length.
_CONNECT = struct.Struct("!iqiqi")
_GRANT = struct.Struct("!iiq")  # protocol version, timeout ms, session id
_CLOSE = struct.Struct("!ii")  # xid, op code (closeSession = -11)


def _endpoints(hosts: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...][/chroot]`` as (host, port) pairs (``[v6]:port`` and a bare host too)."""
    pairs = []
    for entry in hosts.partition("/")[0].split(","):
        item = entry.strip()
        if item.startswith("["):  # [v6]:port
            host, _, rest = item[1:].partition("]")
            port = rest.lstrip(":")
        elif item.count(":") == 1:
            host, _, port = item.partition(":")
        else:  # a bare host name, or a bare IPv6 address
            host, port = item, ""
        if host:
            pairs.append((host, int(port or _DEFAULT_PORT)))
    return pairs


async def _granted_ms(host: str, port: int, requested_ms: int) -> int:
    """The session timeout the server at ``host:port`` grants to a request of ``requested_ms``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        password = bytes(16)
        connect = _CONNECT.pack(0, 0, requested_ms, 0, len(password)) + password + b"\x00"  # read-only: no
        writer.write(_INT.pack(len(connect)) + connect)
        size = _INT.unpack(await reader.readexactly(_INT.size))[0]
        _, granted, session_id = _GRANT.unpack_from(await reader.readexactly(size))
        if session_id:
            # Close the probe's session now rather than leave it to expire (it holds nothing).
            writer.write(_INT.pack(_CLOSE.size) + _CLOSE.pack(1, -11))
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                await asyncio.wait_for(reader.readexactly(_INT.size), 1.0)
        return int(granted)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def negotiated_timeout(hosts: str, requested: float, limit: float) -> float:
    """The smallest session timeout, in seconds, that the servers in ``hosts`` grant for ``requested``.

    Servers that do not answer within ``limit`` seconds are left out (one host of an ensemble may be down).

    Raises:
        OSError: no server answered.
    """
    requested_ms = round(requested * 1000)
    probes = [
        asyncio.ensure_future(_granted_ms(host, port, requested_ms)) for host, port in _endpoints(hosts)
    ]
    if not probes:
        raise OSError(f"no ZooKeeper hosts in {hosts!r}")
    done, pending = await asyncio.wait(probes, timeout=limit)
    for probe in pending:
        probe.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    grants = [p.result() for p in done if p.exception() is None and p.result() > 0]
    if not grants:
        errors = [p.exception() for p in done if p.exception() is not None]
        raise OSError(f"no ZooKeeper server answered a handshake ({errors[0]!r})" if errors else "no answer")
    return min(grants) / 1000


# --- the session ------------------------------------------------------------------------------------------


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
        failed = f"no ZooKeeper session with {self.hosts} within {self.connect_timeout:g} s"
        try:
            granted = await negotiated_timeout(self.hosts, self.session_timeout, self.connect_timeout)
        except OSError as exc:
            raise CoordinatorUnavailable(failed) from exc
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
                sleep_func=_BoundedHandler.sleep_func,
            ),
            command_retry=None,  # our deadlines decide; a retried write could land twice
            auth_data=None if self._auth is None else [("digest", self._auth)],
            default_acl=self.acl,
            read_only=False,
            logger=_KAZOO_LOG,
            # The old aiozk wrapper's bound on a handshake read: long enough for a loaded server.
            handler=_BoundedHandler(min(3.0, self.op_timeout)),
        )
        self._loop = loop
        self._connected = asyncio.Event()  # of this loop (an Event binds to the first loop that waits on it)
        self._client = client
        client.add_listener(functools.partial(self._on_state, client))
        try:
            await _in_thread(client.start_async, "kazoo start")
            await asyncio.wait_for(self._connected.wait(), max(0.0, deadline - loop.time()))
        except BaseException as exc:
            self._client = None
            self._discard(client)
            if isinstance(exc, TimeoutError | OSError | kazoo.exceptions.KazooException):
                raise CoordinatorUnavailable(failed) from exc
            raise
        self._granted = granted
        log.info(
            "ZooKeeper session %#x with %s (timeout %.1f s)", self.session_id or 0, self.hosts, self.timeout
        )

    async def call(self, action: str, request: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """Run ``request(client)`` (a kazoo ``*_async`` call) with a deadline and return its value.

        :data:`NoNode`, :data:`NodeExists`, :data:`BadVersion` and :data:`NotEmpty` pass through for the
        caller to handle; every other failure, and the deadline, become :class:`CoordinatorUnavailable`.

        Args:
            action: What is being done, for the message ("listing workers").
            request: Starts the kazoo call on the client and returns its ``IAsyncResult``.
            timeout: Seconds, waiting for a connection included; ``op_timeout`` when omitted.
        """
        client = self._client
        if client is None:
            raise CoordinatorUnavailable(f"{action}: no ZooKeeper session (not opened, or closed)")
        limit = self.op_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await self._connected.wait()
                return await _answer(request(client))
        except _PASSED_THROUGH:
            raise
        except TimeoutError as exc:
            raise CoordinatorUnavailable(f"{action} ({self.hosts}): no answer within {limit:g} s") from exc
        except kazoo.exceptions.NoAuthError as exc:
            who = "these credentials" if self._auth is not None else "a client without credentials"
            raise CoordinatorUnavailable(
                f"{action} ({self.hosts}): the node's ACL does not allow {who} (NoAuth); "
                "check snowflake.zookeeper_auth"
            ) from exc
        except (kazoo.exceptions.KazooException, OSError) as exc:
            raise CoordinatorUnavailable(f"{action} ({self.hosts}): {type(exc).__name__}: {exc}") from exc

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
            f"creating {path}",
            lambda zk: zk.create_async(
                path, data, acl=self.acl if acl is None else acl, ephemeral=ephemeral, sequence=sequential
            ),
        )
        return str(created)

    async def delete(self, path: str) -> None:
        """Delete a node whatever its version."""
        await self.call(f"deleting {path}", lambda zk: zk.delete_async(path))

    async def get(self, path: str) -> tuple[bytes, NodeStat] | None:
        """Return ``(data, stat)`` of a node, or None when it does not exist."""
        try:
            data, stat = await self.call(f"reading {path}", lambda zk: zk.get_async(path))
        except NoNode:
            return None
        owner = int(stat.ephemeralOwner)
        return bytes(data or b""), NodeStat(version=int(stat.version), ephemeral_owner=owner)

    async def set(self, path: str, data: bytes, version: int) -> None:
        """Write a node's data if its version is still ``version`` (else :data:`BadVersion`)."""
        await self.call(f"writing {path}", lambda zk: zk.set_async(path, data, version))

    async def children(self, path: str) -> list[str]:
        """Return the child names of ``path`` (empty if it does not exist)."""
        try:
            names = await self.call(f"listing {path}", lambda zk: zk.get_children_async(path))
        except NoNode:
            return []
        return [str(n) for n in names]

    async def get_acl(self, path: str) -> list[Any]:
        """Return a node's ACL (kazoo ``ACL`` entries: ``perms``, ``id.scheme``, ``id.id``)."""
        acl, _ = await self.call(f"reading the ACL of {path}", lambda zk: zk.get_acls_async(path))
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
        if _acl_set(current) == _acl_set(self.acl):
            return
        try:
            await self.call(f"restricting {path}", lambda zk: zk.set_acls_async(path, self.acl))
        except NoNode:
            return
        except CoordinatorUnavailable as exc:
            if not isinstance(exc.__cause__, kazoo.exceptions.NoAuthError):
                raise
            log.warning("%s has an ACL of another identity; left as it is", path)
            return
        log.warning(
            "%s had another ACL (%s); restricted it to the configured identity", path, _describe(current)
        )

    # --- closing ------------------------------------------------------------------------------------------

    def _discard(self, client: Any) -> None:
        """Stop a client in the background (kazoo's stop may wait for a connection attempt to time out)."""

        def stop() -> None:
            client.stop()
            client.close()

        task = _in_thread(stop, "kazoo stop")
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
            await asyncio.wait_for(_in_thread(stop, "kazoo stop"), self.op_timeout)
        except (TimeoutError, OSError, kazoo.exceptions.KazooException) as exc:
            # The daemon thread finishes the stop by itself; the server expires the session meanwhile.
            log.info("ZooKeeper session with %s not closed cleanly (%r); left to expire", self.hosts, exc)
