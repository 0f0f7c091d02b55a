"""A TCP proxy that delays each direction by a fixed time: a datacenter boundary on loopback.

``tc netem`` is not available on these machines (docs/datacenters.md); a proxy in user space is the
portable way. This one runs in the test's event loop and only delays (order kept, nothing dropped); the
test kit's fault proxy (latency, blackhole, cut) is to replace it once it is merged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from dispenser.testing.servers._process import LOOPBACK

_CLOSE = b""


class DelayProxy:
    """Forwards connections on :attr:`port` to ``LOOPBACK:target_port``, each byte ``delay`` seconds late each way."""

    def __init__(self, target_port: int, delay: float) -> None:
        """Proxy to ``target_port``, adding ``delay`` seconds to each direction (start with :meth:`running`)."""
        self.target_port = target_port
        self.delay = delay
        self.port = 0
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[DelayProxy]:
        """Listen on a free port of the loopback until the block ends, then cut every connection."""
        server = await asyncio.start_server(self._handle, LOOPBACK, 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
            try:
                await asyncio.gather(
                    self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
                )
            finally:
                server_writer.close()
        except (ConnectionError, OSError):
            pass  # one side went away: the other sees its connection close, as across a real network
        finally:
            client_writer.close()
            self._tasks.discard(task)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                # The latency under test: each chunk leaves `delay` after it arrived, in order.
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:  # the source closed (_CLOSE)
                    sink.close()
                    return
                sink.write(data)
                await sink.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await source.read(65536):
                queue.put_nowait((loop.time() + self.delay, data))
            queue.put_nowait((loop.time() + self.delay, _CLOSE))
            await delivering
        finally:
            delivering.cancel()
