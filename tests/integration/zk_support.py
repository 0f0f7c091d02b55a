"""Helpers for the ZooKeeper tests: a plain client, a proxy that can partition a client, expiring a session."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from kazoo.client import KazooClient  # type: ignore[import-untyped]  # kazoo has no type hints

_SIZE = struct.Struct("!i")

T = TypeVar("T")


class PartitionProxy:
    """A TCP proxy on 127.0.0.1 in front of a server that can cut its clients off without closing anything.

    While :meth:`partition` is in force, bytes in both directions are read and thrown away: the client sees
    a silent network (no reset, no answer), and the server hears nothing, so it expires the session.
    :meth:`heal` closes every connection made so far (their byte streams are torn) and lets new ones through.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.partitioned = False
        self.accepted = 0
        """Connections accepted so far (each client connection attempt that reached the proxy)."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The proxy's listening port."""
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def hosts(self) -> str:
        """The connection string for clients, ``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen on a free port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, server_writer}
        for reader, writer in ((client_reader, server_writer), (server_reader, client_writer)):
            task = asyncio.create_task(self._pump(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                if not self.partitioned:
                    writer.write(chunk)
                    await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def partition(self) -> None:
        """Stop passing bytes; connections stay open."""
        self.partitioned = True

    def heal(self) -> None:
        """Close every connection so far and pass bytes again."""
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        self.partitioned = False

    async def close(self) -> None:
        """Stop listening and close everything."""
        self.heal()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def expire_session(hosts: str, session_id: int, password: bytes) -> None:
    """End a ZooKeeper session from outside, as the server does when it expires: its ephemeral nodes go.

    The classic ZooKeeper test trick: attach a second connection to the session (ID and password) and
    close the session there. The owner's connection is cut; when it reconnects, the server says the
    session is gone. Both requests go out in one write, so the owner's quick reconnect cannot take the
    session back in between; if it does anyway, the close is not acknowledged and we try again.
    """
    host, _, port = hosts.split(",", maxsplit=1)[0].rpartition(":")
    # ConnectRequest: protocol version, last zxid seen, timeout (ms), session id, password; read-only flag.
    connect = struct.pack("!iqiqi", 0, 0, 10_000, session_id, len(password)) + password + b"\x00"
    close = struct.pack("!ii", 1, -11)  # request header: xid 1, closeSession
    frames = b"".join(_SIZE.pack(len(p)) + p for p in (connect, close))
    for _ in range(5):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(frames)
            size = _SIZE.unpack(await asyncio.wait_for(reader.readexactly(4), 5))[0]
            answer = await asyncio.wait_for(reader.readexactly(size), 5)
            # ConnectResponse: protocol version (int), timeout (int), session id (long), password.
            granted = struct.unpack_from("!iiq", answer)[2]
            if granted == 0:
                return  # the session is gone already (an earlier attempt closed it unacknowledged)
            assert granted == session_id, f"the server handed over {granted:#x}, not {session_id:#x}"
            size = _SIZE.unpack(await asyncio.wait_for(reader.readexactly(4), 5))[0]
            xid, _zxid, error = struct.unpack_from(
                "!iqi", await asyncio.wait_for(reader.readexactly(size), 5)
            )
            if xid == 1 and error == 0:
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # cut off before the close was answered: the owner took the session back
        finally:
            writer.close()
            await writer.wait_closed()
        await asyncio.sleep(0.05)
    raise AssertionError(f"could not close session {session_id:#x} from outside")


async def eventually(
    attempt: Callable[[], Awaitable[T]], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> T:
    """Call ``attempt`` until it returns without raising ``AssertionError`` or ``Exception``; return its result.

    Raises:
        AssertionError: still failing after ``timeout`` seconds (with the last failure).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what} not reached within {timeout:g} s; last: {exc!r}") from exc
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def plain_client(hosts: str, **options: Any) -> AsyncIterator[Any]:
    """A bare kazoo client (no credentials unless given in ``options``), as any other program could be.

    Its calls block: run them with ``asyncio.to_thread`` (see :func:`off_loop`).
    """
    client = KazooClient(hosts, timeout=5.0, command_retry=None, **options)
    await asyncio.to_thread(client.start, 5)
    try:
        yield client
    finally:
        await asyncio.to_thread(stop_client, client)


def stop_client(client: Any) -> None:
    """Stop and close a kazoo client."""
    client.stop()
    client.close()


async def off_loop(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking (kazoo) call in a thread."""
    return await asyncio.to_thread(call, *args, **kwargs)
