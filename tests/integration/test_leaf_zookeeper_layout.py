"""The dispenser's `zookeeper` registry among worker nodes laid out as Leaf's SnowflakeZookeeperHolder writes them.

Leaf (Curator) creates, per server address, a persistent sequential node ``/snowflake/<leaf.name>/forever/
<ip>:<port>-<10-digit sequence>`` with the JSON of its ``Endpoint`` (``ip``, ``port`` as a string,
``timestamp``); the sequence number is the worker ID. At start it reads every child of ``forever`` with
``key.split("-")`` and ``Integer.parseInt(nodeKey[1])``. These tests hold the adapter to that layout, with
its root pointed at Leaf's (``snowflake.zookeeper_root = "/snowflake"``): the dispenser's workers take the
next sequence numbers, never one a Leaf server holds, and write nodes Leaf's own start-up can read.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from dispenser.adapters.zookeeper.registry import ZooKeeperRegistry
from dispenser.config import PostgresConfig, SnowflakeConfig
from dispenser.core.errors import InvalidLayout
from dispenser.ports import SystemClock, WorkerRegistry
from dispenser.registries import LEAF_ROOT, layout_of, open_registry
from dispenser_lab.servers.zookeeper import ZooKeeperServer
from tests.integration.zk_support import off_loop, plain_client

pytestmark = pytest.mark.zookeeper


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


def in_leafs_tree(hosts: str, name: str, address: str, stack: AsyncExitStack) -> WorkerRegistry:
    """The registry a worker configured with ``snowflake.zookeeper_root = "/snowflake"`` opens."""
    config = SnowflakeConfig(
        enabled=True,
        mode="zookeeper",
        name=name,
        address=address,
        zookeeper_hosts=hosts,
        zookeeper_root=LEAF_ROOT,
        # The test server's sessions: short timeouts keep the test quick.
        zookeeper_session_timeout=2.0,
        zookeeper_connect_timeout=2.0,
        zookeeper_op_timeout=1.0,
    )
    registry = open_registry(config, PostgresConfig(), layout_of(config), address, SystemClock())
    stack.push_async_callback(registry.close)
    return registry


def leaf_endpoint(ip: str, port: int) -> bytes:
    """Leaf's node data: Jackson's JSON of ``Endpoint(ip, String.valueOf(port), currentTimeMillis())``."""
    return json.dumps({"ip": ip, "port": str(port), "timestamp": time.time_ns() // 1_000_000}).encode()


def leaf_reads_worker_ids(children: list[str]) -> dict[str, int]:
    """What a Leaf server's init does with ``forever``'s children: ``split("-")``, ``parseInt(nodeKey[1])``.

    Raises ValueError where Java's ``Integer.parseInt`` throws NumberFormatException (Leaf's start then fails
    over to its cached workerID.properties, or does not start).
    """
    ids = {}
    for key in children:
        node_key = key.split("-")
        if not node_key[1].isdigit():
            raise ValueError(f"not a number: {node_key[1]}")  # Java: NumberFormatException
        ids[node_key[0]] = int(node_key[1])
    return ids


async def test_dispenser_workers_take_the_next_ids_beside_leafs_and_leaf_can_read_their_nodes(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    forever = f"{LEAF_ROOT}/{zk_namespace}/forever"
    async with plain_client(zookeeper_server.hosts) as leaf:  # two Leaf servers, as Curator creates them
        for ip, port in (("10.0.0.1", 8080), ("10.0.0.2", 8080)):
            await off_loop(
                leaf.create, f"{forever}/{ip}:{port}-", leaf_endpoint(ip, port), sequence=True, makepath=True
            )

        registry = in_leafs_tree(zookeeper_server.hosts, zk_namespace, "10.0.0.9:9000", stack)
        lease = await registry.register()
        assert lease.worker_id == 2  # not 0 or 1: those are the Leaf servers'

        children = await off_loop(leaf.get_children, forever)
        assert sorted(children) == [
            "10.0.0.1:8080-0000000000",
            "10.0.0.2:8080-0000000001",
            "10.0.0.9:9000-0000000002",
        ]
        assert leaf_reads_worker_ids(children) == {"10.0.0.1:8080": 0, "10.0.0.2:8080": 1, "10.0.0.9:9000": 2}
        data, _ = await off_loop(leaf.get, f"{forever}/10.0.0.9:9000-0000000002")
        endpoint = json.loads(data)  # what Leaf's deBuildData reads into its Endpoint
        assert endpoint["ip"] == "10.0.0.9"
        assert endpoint["port"] == "9000"
        assert isinstance(endpoint["timestamp"], int)

        # A Leaf server started now gets the next number, and the dispenser's worker keeps its own.
        await off_loop(
            leaf.create, f"{forever}/10.0.0.3:8080-", leaf_endpoint("10.0.0.3", 8080), sequence=True
        )
        await registry.close()
        again = in_leafs_tree(zookeeper_server.hosts, zk_namespace, "10.0.0.9:9000", stack)
        assert (await again.register()).worker_id == 2
        ids = leaf_reads_worker_ids(await off_loop(leaf.get_children, forever))
        assert sorted(ids.values()) == [0, 1, 2, 3]  # four workers, four IDs


async def test_an_address_with_a_dash_would_break_leafs_start_so_it_is_refused(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """Why shared workers need ``snowflake.address = "ip:port"``: an identity like ``web-1:3fa2c0de`` is not Leaf-readable."""
    registry = ZooKeeperRegistry(  # the adapter alone would register it…
        zookeeper_server.hosts,
        zk_namespace,
        "web-1:3fa2c0de",
        max_worker_id=1023,
        root=LEAF_ROOT,
        session_timeout=2.0,
        connect_timeout=2.0,
        op_timeout=1.0,
    )
    stack.push_async_callback(registry.close)
    await registry.register()
    async with plain_client(zookeeper_server.hosts) as leaf:
        children = await off_loop(leaf.get_children, f"{LEAF_ROOT}/{zk_namespace}/forever")
    assert children == ["web-1:3fa2c0de-0000000000"]
    with pytest.raises(ValueError, match="not a number: 1:3fa2c0de"):  # …and Leaf's next start would fail
        leaf_reads_worker_ids(children)
    # …so a worker configured to share Leaf's registry refuses to start with it.
    with pytest.raises(InvalidLayout, match="an address without '-'"):
        in_leafs_tree(zookeeper_server.hosts, zk_namespace, "web-2:77aa00ff", stack)
