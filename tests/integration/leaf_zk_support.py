"""A Leaf snowflake server's ZooKeeper side, as Meituan's ``SnowflakeZookeeperHolder`` does it, for tests.

What Leaf does with ZooKeeper (Curator, no credentials), in its order:

* ``init()``: list ``/snowflake/<leaf.name>/forever``. No node for its ``ip:port``: create the persistent
  sequential node ``forever/<ip>:<port>-`` with its ``Endpoint`` as JSON (``ip``, ``port`` as a string,
  ``timestamp`` = ``System.currentTimeMillis()``), its sequence number the worker ID. A node for its
  address: take its sequence number, and ``checkInitTimeStamp``: refuse to start (``init`` fails) when
  the node's timestamp is later than the local clock.
* ``ScheduledUploadData``: ``scheduleWithFixedDelay(…, 1L, 3L, TimeUnit.SECONDS)``, each run
  ``updateNewData``: ``setData().forPath(node, buildData())``, the ``Endpoint`` with the current time
  (unconditionally: no version). So a live Leaf server's node is rewritten every 3 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from tests.integration.zk_support import off_loop

LEAF_FIRST_UPLOAD_S = 1.0
"""``scheduleWithFixedDelay``'s initial delay in Leaf."""
LEAF_UPLOAD_EVERY_S = 3.0
"""``scheduleWithFixedDelay``'s delay in Leaf: its node is rewritten every 3 s."""


class LeafInitFailed(Exception):
    """Leaf's ``checkInitTimeStamp`` failed: its node holds a timestamp later than its clock."""


def endpoint(ip: str, port: int) -> bytes:
    """Leaf's node data: Jackson's JSON of ``Endpoint(ip, String.valueOf(port), currentTimeMillis())``."""
    return json.dumps({"ip": ip, "port": str(port), "timestamp": time.time_ns() // 1_000_000}).encode()


class LeafZkServer:
    """One Leaf server's registration in ZooKeeper, kept fresh while it runs (``start``, ``stop``).

    Args:
        client: A plain kazoo client (see :func:`tests.integration.zk_support.plain_client`).
        name: ``leaf.name``: the node is under ``/snowflake/<name>/forever``.
        ip: The server's IP.
        port: The server's port.
    """

    def __init__(self, client: Any, name: str, ip: str, port: int) -> None:
        self.client = client
        self.forever = f"/snowflake/{name}/forever"
        self.ip = ip
        self.port = port
        self.node: str | None = None
        self.worker_id: int | None = None
        self.uploads = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``ip:port``, what Leaf names its node after."""
        return f"{self.ip}:{self.port}"

    async def start(self) -> int:
        """Leaf's ``init()``, then its scheduled uploads in the background; returns the worker ID.

        Raises:
            LeafInitFailed: its node's timestamp is later than the clock (Leaf would not start).
        """
        await off_loop(self.client.ensure_path, self.forever)
        children = await off_loop(self.client.get_children, self.forever)
        mine = [c for c in children if c.split("-")[0] == self.address]
        if mine:
            self.node = f"{self.forever}/{mine[0]}"
            self.worker_id = int(mine[0].split("-")[1])
            data, _ = await off_loop(self.client.get, self.node)
            if json.loads(data)["timestamp"] > time.time_ns() // 1_000_000:
                raise LeafInitFailed(f"{self.node} holds a timestamp later than this server's clock")
        else:
            node: str = await off_loop(
                self.client.create,
                f"{self.forever}/{self.address}-",
                endpoint(self.ip, self.port),
                sequence=True,
            )
            self.node = node
            self.worker_id = int(node.rpartition("-")[2])
        self._task = asyncio.create_task(self._upload())
        return self.worker_id

    async def _upload(self) -> None:
        await asyncio.sleep(LEAF_FIRST_UPLOAD_S)
        while True:
            await off_loop(self.client.set, self.node, endpoint(self.ip, self.port))
            self.uploads += 1
            await asyncio.sleep(LEAF_UPLOAD_EVERY_S)

    async def stop(self) -> None:
        """The server is gone: no more uploads (its node stays, as Leaf's does)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
