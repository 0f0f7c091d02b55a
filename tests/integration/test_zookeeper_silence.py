"""A session that keeps asking leaves a ZooKeeper server that went silent, within half its session timeout.

kazoo drops a connection only when a ping goes unanswered through a quiet stretch, and each request counts
as a ping: a client asking every second (a lease keepalive) never had one, and stayed on a server cut off
server-to-client for as long as it kept asking. :class:`~dispenser.adapters.zookeeper.handler.BoundedHandler`
drops a server that has sent nothing for ``T/2``; kazoo then goes to the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from dispenser.adapters.zookeeper.session import ZkSession
from dispenser.core.errors import CoordinatorUnavailable
from dispenser_lab.faultproxy import FaultProxy
from dispenser_lab.servers import ZooKeeperServer
from tests.integration.segment_support import wait_until

pytestmark = [pytest.mark.zookeeper]


async def test_a_busy_session_leaves_a_server_that_sends_nothing(zookeeper_server: ZooKeeperServer) -> None:
    """Two ways to the same server; the one in use is cut server-to-client while the session keeps asking.

    The session goes to the other way within T/2 (plus a reconnect), keeping its ID. Before: never, as long
    as the asking went on (the test's 15 s).
    """
    target = ("127.0.0.1", zookeeper_server.port)
    async with FaultProxy(target) as first, FaultProxy(target) as second:
        session = ZkSession(
            f"{first.host}:{first.port},{second.host}:{second.port}",
            session_timeout=4.0,
            connect_timeout=5.0,
            op_timeout=1.0,
        )
        await session.open()
        try:
            session_id = session.session_id
            await wait_until(  # the handshakes asking for the timeout are closing
                lambda: [first.connections, second.connections] in ([1, 0], [0, 1]),
                what="one connection to the server left",
                timeout=5,
            )
            used, other = (first, second) if first.connections else (second, first)
            await session.get("/")
            used.cut("downstream")
            cut_at = time.monotonic()
            answered: list[float] = []

            async def ask() -> None:
                with contextlib.suppress(CoordinatorUnavailable):
                    await session.get("/")
                    answered.append(time.monotonic())

            # Ask five times a second, as a busy worker does (lease keepalive, renewals, re-registering):
            # every call is an implicit ping to kazoo.
            asking: set[asyncio.Task[None]] = set()
            while not answered:
                assert time.monotonic() - cut_at < 15, "still on the silent server"
                task = asyncio.create_task(ask())
                asking.add(task)
                task.add_done_callback(asking.discard)
                await asyncio.sleep(0.2)
            await asyncio.gather(*asking)
            back_in = answered[0] - cut_at
            assert other.connections == 1
            assert session.session_id == session_id
            assert back_in < session.timeout / 2 + 1.5, (back_in, session.timeout)
            print(f"back on the other way {back_in:.2f} s after the cut (T = {session.timeout:g} s)")
        finally:
            first.heal()
            second.heal()
            await session.close()
