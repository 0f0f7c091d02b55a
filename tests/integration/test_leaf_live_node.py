"""Sharing Leaf's registry: a worker never takes the worker ID of a live Leaf server (issue 29 item 7).

Leaf's scheme gives an address its own node back, so a dispenser worker configured with a running Leaf
server's ``ip:port`` (``snowflake.zookeeper_root = "/snowflake"``) would find that server's node and take
its worker ID: both would hand out the same IDs. A live Leaf server rewrites its node every 3 s; the
nodes here are kept fresh exactly so (``tests/integration/leaf_zk_support.py``), in the kit's ZooKeeper.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from msgspec.structs import replace

from dispenser.adapters.zookeeper.registry import ZooKeeperRegistry
from dispenser.config import Config
from dispenser.core.errors import CoordinatorUnavailable, WorkerNodeAlive
from dispenser.registries import LEAF_ROOT
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.process import free_port
from dispenser_lab.servers.zookeeper import ZooKeeperServer
from tests.integration.leaf_zk_support import LeafInitFailed, LeafZkServer, endpoint
from tests.integration.zk_support import eventually, off_loop, plain_client

from .segment_support import client as nats_client
from .segment_support import running_worker
from .snowflake_support import refused, snowflake_config, subject, take

pytestmark = [pytest.mark.zookeeper, pytest.mark.nats]

LEAF_ADDRESS = ("10.0.3.7", 8080)


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


def sharing(
    nats: NatsServer,
    zk: ZooKeeperServer,
    state: Path,
    name: str,
    address: str,
    *,
    report_interval: float = 0.2,
) -> Config:
    """A worker configured to share Leaf's registry, as docs/migrating-from-leaf.md shows."""
    return snowflake_config(
        nats.url,
        state,
        name=name,
        mode="zookeeper",
        prefix=name,
        address=address,
        zookeeper_hosts=zk.hosts,
        zookeeper_root=LEAF_ROOT,
        zookeeper_session_timeout=2.0,
        zookeeper_connect_timeout=2.0,
        report_interval=report_interval,
    )


async def test_a_worker_given_a_live_leaf_servers_address_refuses_its_worker_id(
    nats_server: NatsServer, zookeeper_server: ZooKeeperServer, zk_namespace: str, tmp_path: Path
) -> None:
    """Leaf's node for 10.0.3.7:8080 is rewritten every 3 s: the worker with that address refuses, naming it."""
    async with plain_client(zookeeper_server.hosts) as client:
        leaf = LeafZkServer(client, zk_namespace, *LEAF_ADDRESS)
        worker_id = await leaf.start()
        try:

            async def uploading() -> None:
                assert leaf.uploads >= 1

            await eventually(
                uploading, what="Leaf's first upload", timeout=5.0
            )  # a server running for a while
            config = sharing(nats_server, zookeeper_server, tmp_path, zk_namespace, leaf.address)
            error = await refused(config)
        finally:
            await leaf.stop()
    assert isinstance(error, WorkerNodeAlive), error
    message = str(error)
    assert f"worker ID {worker_id}" in message
    assert f"Leaf server at {leaf.address}" in message
    assert "snowflake.address" in message


async def test_a_node_nobody_keeps_fresh_is_taken_with_its_worker_id(
    zookeeper_server: ZooKeeperServer, zk_namespace: str, stack: AsyncExitStack
) -> None:
    """A Leaf server stopped for good (its host moved to the dispenser): its node is taken once quiet.

    The window is shortened here (1 s; the worker uses 2 x Leaf's 3 s + 1 s): the rule, not the constant.
    """
    async with plain_client(zookeeper_server.hosts) as client:
        leaf = LeafZkServer(client, zk_namespace, *LEAF_ADDRESS)
        worker_id = await leaf.start()
        await leaf.stop()  # before its first upload: its node was written once, at init
    registry = ZooKeeperRegistry(
        zookeeper_server.hosts,
        zk_namespace,
        leaf.address,
        max_worker_id=1023,
        root=LEAF_ROOT,
        session_timeout=2.0,
        connect_timeout=2.0,
        op_timeout=1.0,
        quiet_window=1.0,
    )
    stack.push_async_callback(registry.close)
    lease = await registry.register()
    assert lease.worker_id == worker_id  # Leaf's scheme: the address gets its own ID back
    assert lease.high_water_ms > 0  # and the worker issues above Leaf's last timestamp


async def test_a_leaf_server_started_beside_a_live_worker_with_its_address_does_not_start(
    nats_server: NatsServer, zookeeper_server: ZooKeeperServer, zk_namespace: str, tmp_path: Path
) -> None:
    """The other order: the worker's node holds a reserved mark ahead of the clock, and Leaf's init refuses."""
    config = sharing(
        nats_server, zookeeper_server, tmp_path, zk_namespace, "10.0.3.7:8080", report_interval=1.0
    )
    async with running_worker(config), plain_client(zookeeper_server.hosts) as client:
        leaf = LeafZkServer(client, zk_namespace, *LEAF_ADDRESS)
        with pytest.raises(LeafInitFailed):
            await leaf.start()


async def test_a_node_rewritten_by_someone_else_while_serving_stops_the_worker(
    nats_server: NatsServer,
    zookeeper_server: ZooKeeperServer,
    zk_namespace: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Leaf server that got past its init (a clock far ahead) writes the worker's node: the worker stops."""
    address = "10.0.3.7:8080"
    config = sharing(nats_server, zookeeper_server, tmp_path, zk_namespace, address)
    async with (
        running_worker(config) as worker,
        plain_client(zookeeper_server.hosts) as client,
        nats_client(nats_server.url) as nc,
    ):
        await take(nc, subject(zk_namespace))
        forever = f"{LEAF_ROOT}/{zk_namespace}/forever"
        (node,) = await off_loop(client.get_children, forever)
        with caplog.at_level(logging.WARNING):
            await off_loop(client.set, f"{forever}/{node}", endpoint(*LEAF_ADDRESS))  # as Leaf's upload

            async def stopped() -> None:
                assert not worker.registration.can_issue()

            await eventually(stopped, what="the worker stops issuing", timeout=5.0)
        assert any("rewritten by someone else" in r.getMessage() for r in caplog.records)


async def test_sharing_leafs_registry_never_starts_from_the_local_cache(
    nats_server: NatsServer, zookeeper_server: ZooKeeperServer, zk_namespace: str, tmp_path: Path
) -> None:
    """ZooKeeper down at start: only ZooKeeper could show no Leaf server took the address meanwhile."""
    config = sharing(nats_server, zookeeper_server, tmp_path, zk_namespace, "10.0.3.8:9000")
    async with running_worker(config):
        pass  # registered: the local cache now holds its worker ID
    nowhere = f"127.0.0.1:{free_port()}"
    unreachable = replace(config, snowflake=replace(config.snowflake, zookeeper_hosts=nowhere))
    error = await refused(unreachable)
    assert isinstance(error, CoordinatorUnavailable), error
