"""A TCP fault proxy for tests: put it between a client and a server, then slow, freeze, cut or reset the link.

What Toxiproxy gives Go and Java projects, in the test's own process and without a daemon;
:class:`ThreadedFaultProxy` runs one on a loop in a thread for synchronous tests. The methods, the
directions and what a held direction means: ``docs/testing.md`` ("Hangs and partitions: the fault proxy").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

__all__ = ["Direction", "FaultProxy", "ThreadedFaultProxy"]

log = logging.getLogger(__name__)

Direction = Literal["upstream", "downstream"]
"""``upstream``: client to server; ``downstream``: server to client."""

T = TypeVar("T")

_CHUNK = 65536
_QUEUED_CHUNKS = 64  # per direction, between the reader and the delayed writer: bounds memory under latency
_DIRECTIONS: tuple[Direction, Direction] = ("upstream", "downstream")


class _Gate:
    """Whether a direction may flow; waiters wake when it opens."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()

    def close(self) -> None:
        self.open.clear()

    def release(self) -> None:
        self.open.set()


class _Link:
    """One client connection and its upstream connection, with a pump per direction."""

    def __init__(self, proxy: FaultProxy, client: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.handler = asyncio.current_task()
        self.holding = False  # accepted during a blackhole, not yet connected upstream

    def close(self) -> None:
        """Close both sockets (a FIN each: what was written is sent first)."""
        for writer in (self.client, self.server):
            if writer is not None:
                writer.close()

    def reset(self) -> None:
        """Close both sockets at once with a TCP reset (SO_LINGER 0) and stop the pumps."""
        for writer in (self.client, self.server):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()
        if self.holding and self.handler is not None:
            self.handler.cancel()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``upstream`` that passes, delays, holds or resets traffic on demand.

    Args:
        upstream: the server's ``(host, port)``.
        port: the port to listen on (0: a free one; a fixed one lets :meth:`enable` reopen the same).
        host: the address to listen on (loopback).

    The fault methods take effect at once, on open connections and new ones, and may be combined (a
    latency stays while a direction is cut). Use it as an async context manager, or :meth:`start` and
    :meth:`stop`.
    """

    def __init__(self, upstream: tuple[str, int], *, port: int = 0, host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._gates: dict[Direction, _Gate] = {}
        self._latency: dict[Direction, float] = {"upstream": 0.0, "downstream": 0.0}
        self._hold_new = False
        self.accepted = 0
        """Connections accepted since the start."""

    # -- life cycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (on a free port unless one was given); :attr:`port` is then the port."""
        if not self._gates:
            self._gates = {direction: _Gate() for direction in _DIRECTIONS}
        self._server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and close every connection (with a reset: nothing is owed to anyone)."""
        await self.disable()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect: ``(host, port)``."""
        return (self.host, self.port)

    def url(self, scheme: str) -> str:
        """Where clients connect, as a URL: ``url("nats")`` is ``nats://127.0.0.1:<port>``."""
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections open through the proxy now."""
        return len(self._links)

    # -- faults ---------------------------------------------------------------------------------------

    def heal(self) -> None:
        """Pass everything again: no latency, nothing held (held bytes flow on, in order)."""
        self._latency = {"upstream": 0.0, "downstream": 0.0}
        self._hold_new = False
        for gate in self._gates.values():
            gate.release()

    def latency(self, seconds: float, downstream: float | None = None) -> None:
        """Delay every chunk by ``seconds`` each way (or ``seconds`` upstream and ``downstream`` down)."""
        if seconds < 0 or (downstream is not None and downstream < 0):
            raise ValueError("latency cannot be negative")
        self._latency = {"upstream": seconds, "downstream": seconds if downstream is None else downstream}

    def blackhole(self) -> None:
        """Accept new connections and never answer them; stop forwarding on open ones, both ways.

        What a frozen server or a partition looks like to a client: TCP connects (the proxy accepts),
        then silence. New connections reach the server only after :meth:`heal`.
        """
        self._hold_new = True
        for gate in self._gates.values():
            gate.close()

    def cut(self, direction: Direction) -> None:
        """Stop forwarding one way on every connection, open and new (a one-way partition)."""
        self._gates[direction].close()

    def reset(self) -> None:
        """End every open connection with a TCP reset, both sides (new ones are accepted as usual)."""
        for link in list(self._links):
            link.reset()
        self._links.clear()

    async def disable(self) -> None:
        """Stop listening (new connections are refused) and reset every open one: the server is "down"."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self.reset()
        # The handlers end once their pumps are cancelled: wait, so that none outlives the proxy's loop.
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def enable(self) -> None:
        """Listen again on the same port after :meth:`disable`."""
        if self._server is None:
            await self.start()

    # -- forwarding -----------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        link = _Link(self, writer)
        self._links.add(link)
        try:
            if self._hold_new:  # accept and never answer: not even the server sees it until healed
                link.holding = True
                await asyncio.gather(*(gate.open.wait() for gate in self._gates.values()))
                link.holding = False
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError as exc:
                log.debug("fault proxy: upstream %s:%d refused: %s", *self.upstream, exc)
                link.reset()
                return
            link.server = up_writer
            link.tasks = [
                asyncio.create_task(self._pump(link, reader, up_writer, "upstream")),
                asyncio.create_task(self._pump(link, up_reader, writer, "downstream")),
            ]
            await asyncio.gather(*link.tasks, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # reset() or stop(): the sockets are closed already
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(
        self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter, direction: Direction
    ) -> None:
        """Copy one direction: a reader reads while the gate is open; a writer delays and writes in order.

        A reset on either side resets the other (a half-close is passed on as a half-close).
        """
        gate = self._gates[direction]
        # (read at, bytes): b"" is the source's half-close, None a reset of the source.
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(_QUEUED_CHUNKS)

        async def read() -> None:
            while True:
                await gate.open.wait()  # held: leave the bytes in the kernel's buffers
                try:
                    data: bytes | None = await source.read(_CHUNK)
                except OSError:
                    data = None
                await queue.put((time.monotonic(), data))
                if not data:
                    return

        reader = asyncio.create_task(read())
        try:
            while True:
                read_at, data = await queue.get()
                await gate.open.wait()  # read just before the gate closed: held here instead
                # A loop, not one sleep: uvloop's timers tick in milliseconds and can wake up to 1 ms
                # early (measured: 152 of 200 sleeps of 20.5 ms), and a latency must never come out short.
                while (delay := read_at + self._latency[direction] - time.monotonic()) > 0:  # noqa: ASYNC110 (a deadline, not a poll)
                    await asyncio.sleep(delay)
                await gate.open.wait()
                if data is None:
                    link.reset()
                    return
                if not data:  # pass the half-close on
                    if sink.can_write_eof():
                        sink.write_eof()
                    return
                sink.write(data)
                await sink.drain()
        except OSError:  # the sink is gone: the source gets a reset too
            link.reset()
        finally:
            reader.cancel()


class ThreadedFaultProxy:
    """A :class:`FaultProxy` on an event loop in a thread of its own, for synchronous tests.

    Same faults, as blocking methods (each returns once it has taken effect)::

        with ThreadedFaultProxy(("127.0.0.1", nats.port)) as proxy:
            start_worker(nats_url=proxy.url("nats"))
            proxy.blackhole()
    """

    def __init__(self, upstream: tuple[str, int], *, port: int = 0, host: str = "127.0.0.1") -> None:
        self.proxy = FaultProxy(upstream, port=port, host=host)
        """The proxy itself (runs on the thread's loop: call it through :meth:`call`)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    def start(self) -> None:
        """Start the thread and listen."""
        self._thread.start()
        self._run(self.proxy.start())

    def stop(self) -> None:
        """Close every connection, stop listening, stop the thread."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self.proxy.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(30)

    def _do(self, action: Any, *args: Any) -> None:
        done: Future[None] = Future()

        def run() -> None:
            try:
                action(*args)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        self._loop.call_soon_threadsafe(run)
        done.result(30)

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        return self.proxy.port

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect: ``(host, port)``."""
        return self.proxy.address

    def url(self, scheme: str) -> str:
        """Where clients connect, as a URL (``url("nats")``)."""
        return self.proxy.url(scheme)

    @property
    def connections(self) -> int:
        """Connections open through the proxy now."""
        return self.proxy.connections

    def heal(self) -> None:
        """As :meth:`FaultProxy.heal`."""
        self._do(self.proxy.heal)

    def latency(self, seconds: float, downstream: float | None = None) -> None:
        """As :meth:`FaultProxy.latency`."""
        self._do(self.proxy.latency, seconds, downstream)

    def blackhole(self) -> None:
        """As :meth:`FaultProxy.blackhole`."""
        self._do(self.proxy.blackhole)

    def cut(self, direction: Direction) -> None:
        """As :meth:`FaultProxy.cut`."""
        self._do(self.proxy.cut, direction)

    def reset(self) -> None:
        """As :meth:`FaultProxy.reset`."""
        self._do(self.proxy.reset)

    def disable(self) -> None:
        """As :meth:`FaultProxy.disable`."""
        self._run(self.proxy.disable())

    def enable(self) -> None:
        """As :meth:`FaultProxy.enable`."""
        self._run(self.proxy.enable())
