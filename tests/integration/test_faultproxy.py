"""The fault proxy of the test kit (dispenser_lab.faultproxy) against a real echo server and a real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from dispenser_lab.faultproxy import FaultProxy, ThreadedFaultProxy
from dispenser_lab.servers import NatsServer

# How long a test waits to be sure that nothing comes: long against loopback's microseconds.
QUIET = 0.3


class Echo:
    """An echo server on 127.0.0.1 that remembers what it received and how its connections ended."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.got = asyncio.Event()
        self.endings: list[str] = []
        self.ended = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.received += data
                self.got.set()
                writer.write(data)
                await writer.drain()
            self.endings.append("eof")
        except ConnectionResetError:
            self.endings.append("reset")
        finally:
            self.ended.set()
            writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])


@contextlib.asynccontextmanager
async def echo_behind_proxy() -> AsyncIterator[tuple[Echo, FaultProxy]]:
    echo = Echo()
    echo.server = await asyncio.start_server(echo.handle, "127.0.0.1", 0)
    try:
        async with FaultProxy(("127.0.0.1", echo.port)) as proxy:
            yield echo, proxy
    finally:
        echo.server.close()


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await reader.readexactly(len(data))


async def test_passes_both_ways_and_half_closes() -> None:
    async with echo_behind_proxy() as (echo, proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        assert await round_trip(reader, writer, b"hello") == b"hello"
        big = bytes(range(256)) * 4096  # 1 MiB: many chunks, in order
        assert await round_trip(reader, writer, big) == big
        assert proxy.connections == 1
        writer.write_eof()
        assert await reader.read() == b""  # the server saw the half-close and closed its side
        await echo.ended.wait()
        assert echo.endings == ["eof"]
        writer.close()


async def test_latency_per_direction_is_pipelined() -> None:
    async with echo_behind_proxy() as (_, proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        proxy.latency(0.02)  # 20 ms each way
        started = time.monotonic()
        assert await round_trip(reader, writer, b"x") == b"x"
        assert time.monotonic() - started >= 0.04
        proxy.latency(0.0, downstream=0.05)
        started = time.monotonic()
        assert await round_trip(reader, writer, b"y") == b"y"
        assert time.monotonic() - started >= 0.05
        # Twenty chunks sent back to back: each is delayed, not queued behind the others' delays.
        proxy.latency(0.05)
        started = time.monotonic()
        for i in range(20):
            writer.write(b"%02d" % i)
            await writer.drain()
            await asyncio.sleep(0.002)  # separate chunks
        assert await reader.readexactly(40) == b"".join(b"%02d" % i for i in range(20))
        elapsed = time.monotonic() - started
        assert 0.1 <= elapsed < 20 * 0.1 / 2, elapsed
        writer.close()


async def test_latency_never_comes_out_short() -> None:
    # uvloop's timers tick in whole milliseconds and wake up to 1 ms early: a latency of 20.5 ms (rounded down
    # to 20 by them), one way only, shows a proxy that trusts a single sleep.
    async with echo_behind_proxy() as (_, proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        proxy.latency(0.0205, downstream=0.0)
        for _ in range(30):
            started = time.monotonic()
            assert await round_trip(reader, writer, b"x") == b"x"
            assert time.monotonic() - started >= 0.0205
        writer.close()


async def test_blackhole_accepts_holds_and_heal_delivers_in_order() -> None:
    async with echo_behind_proxy() as (echo, proxy):
        old_reader, old_writer = await asyncio.open_connection(*proxy.address)
        assert await round_trip(old_reader, old_writer, b"before") == b"before"
        proxy.blackhole()
        # An open connection: what it sends goes nowhere, for now.
        old_writer.write(b"during")
        # A new connection: TCP connects (the proxy accepts), and then silence; the server never sees it.
        new_reader, new_writer = await asyncio.open_connection(*proxy.address)
        new_writer.write(b"new")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(old_reader.readexactly(6), QUIET)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(new_reader.readexactly(3), QUIET)
        assert bytes(echo.received) == b"before"
        proxy.heal()  # held, not dropped: both get their answer
        assert await asyncio.wait_for(old_reader.readexactly(6), 5) == b"during"
        assert await asyncio.wait_for(new_reader.readexactly(3), 5) == b"new"
        old_writer.close()
        new_writer.close()


async def test_cut_one_direction() -> None:
    async with echo_behind_proxy() as (echo, proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        proxy.cut("downstream")  # the server hears, the client does not
        writer.write(b"ping")
        await asyncio.wait_for(echo.got.wait(), 5)
        assert bytes(echo.received) == b"ping"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), QUIET)
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        proxy.cut("upstream")  # the server hears nothing
        echo.got.clear()
        writer.write(b"pong")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(echo.got.wait(), QUIET)
        assert bytes(echo.received) == b"ping"
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"pong"
        writer.close()


async def test_reset_ends_both_sides_with_a_reset() -> None:
    async with echo_behind_proxy() as (echo, proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        assert await round_trip(reader, writer, b"a") == b"a"
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), 5)
        await asyncio.wait_for(echo.ended.wait(), 5)
        assert echo.endings == ["reset"]
        assert proxy.connections == 0
        writer.close()
        # New connections pass as before.
        reader, writer = await asyncio.open_connection(*proxy.address)
        assert await round_trip(reader, writer, b"b") == b"b"
        writer.close()


async def test_disable_refuses_and_enable_listens_on_the_same_port() -> None:
    async with echo_behind_proxy() as (_, proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        port = proxy.port
        await proxy.disable()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), 5)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(*proxy.address)
        await proxy.enable()
        assert proxy.port == port
        reader, writer = await asyncio.open_connection(*proxy.address)
        assert await round_trip(reader, writer, b"c") == b"c"
        writer.close()


async def test_nats_through_the_proxy(nats_server: NatsServer) -> None:
    """A NATS client connected through the proxy: a blackhole stalls it silently, the heal resumes it."""
    async with FaultProxy(("127.0.0.1", nats_server.port)) as proxy:
        nc: Client = await nats.connect(proxy.url("nats"), allow_reconnect=False)
        try:
            sub = await nc.subscribe("proxy.test")
            await nc.flush(timeout=5)
            proxy.blackhole()
            # Not flush() to test the silence: nats-py's read loop dies of a PONG that comes after its
            # flush timed out (InvalidStateError on the cancelled future).
            await nc.publish("proxy.test", b"held")
            with pytest.raises(TimeoutError):
                await sub.next_msg(timeout=QUIET)
            assert nc.is_connected  # nothing failed: the connection is merely silent
            proxy.heal()
            assert (await sub.next_msg(timeout=5)).data == b"held"
        finally:
            await nc.close()


def test_threaded_proxy_for_synchronous_tests(nats_server: NatsServer) -> None:
    """The same faults from a test without an event loop (the proxy runs on a thread's)."""
    with ThreadedFaultProxy(("127.0.0.1", nats_server.port)) as proxy:
        with socket.create_connection(proxy.address, timeout=5) as sock:
            assert sock.recv(4096).startswith(b"INFO ")
            proxy.blackhole()
            assert proxy.connections == 1
        with socket.create_connection(proxy.address, timeout=QUIET) as sock:
            with pytest.raises(TimeoutError):
                sock.recv(4096)  # accepted, never answered
            proxy.heal()
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"INFO ")
