"""High-availability tests: a real 3-node Patroni cluster (PostgreSQL 15, ZooKeeper DCS) killed under load.

One cluster serves the whole session (starting one takes ~15 s): strict synchronous replication, ZooKeeper
sessions capped at 6 s so that a killed leader is replaced in ~6-7 s. A test that kills a node leaves it
down; the next test's ``ha_cluster`` brings it back (from a fresh copy of the leader) and waits until every
node streams again. A test that changes the replication mode puts it back.

Fixtures:
    patroni_cluster: the session's cluster (use ``ha_cluster`` in tests).
    ha_cluster: the cluster, healthy (3 nodes, one synchronous standby) when the test starts.
    ha_dsn: a fresh database of the test's own on the cluster, as a multi-host read-write DSN.
    nats_cluster, zk_ensemble, kafka_cluster: three routed NATS servers, a 3-server ZooKeeper ensemble and
        three KRaft Kafka nodes, shared by the session (see ``cluster_support``); a test that kills a member
        restarts it before it ends.
    kafka_proxies: a fault proxy in front of each Kafka node, for clients of ``proxied_bootstrap``.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from dispenser_lab.servers import DevServerError
from dispenser_lab.servers.patroni import PatroniCluster
from tests.ha.cluster_support import kafka_cluster, kafka_proxies, nats_cluster, zk_ensemble

__all__ = [
    "ha_cluster",
    "ha_dsn",
    "kafka_cluster",
    "kafka_proxies",
    "nats_cluster",
    "patroni_cluster",
    "zk_ensemble",
]


@pytest.fixture(scope="session")
def patroni_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatroniCluster]:
    """The session's Patroni cluster (strict synchronous mode, 6 s ZooKeeper sessions)."""
    cluster = PatroniCluster(tmp_path_factory.mktemp("patroni"))
    try:
        cluster.start()
    except DevServerError as exc:
        cluster.stop()
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def restore(cluster: PatroniCluster) -> None:
    """Bring back every stopped node (from a fresh copy of the leader) and wait until all stream."""
    if cluster.synchronous != "strict":
        cluster.set_synchronous("strict")
    cluster.wait_leader()
    for node in cluster.nodes:
        if not node.running:
            node.reset()
            node.start()
    cluster.wait_healthy()


@pytest.fixture
def ha_cluster(patroni_cluster: PatroniCluster) -> PatroniCluster:
    """The session's cluster, with every node streaming and one synchronous standby."""
    try:
        restore(patroni_cluster)
    except DevServerError as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)
    return patroni_cluster


_numbers = itertools.count(1)


@pytest.fixture
async def ha_dsn(ha_cluster: PatroniCluster, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A new database named after the test, on whichever node is the primary; dropped afterwards."""
    slug = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower()).strip("_")
    name = f"ha{next(_numbers)}_{slug}"[:63]
    conn = await asyncpg.connect(ha_cluster.dsn, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    # On every node before the test connects: asyncpg stops at a replica listed before the primary that
    # answers "database does not exist" (an asynchronous one may not have replayed the CREATE yet).
    query = f"SELECT count(*) FROM pg_database WHERE datname = '{name}'"
    for _ in range(300):
        if all(node.sql(query) == "1" for node in ha_cluster.nodes if node.running):
            break
        await asyncio.sleep(0.1)
    yield ha_cluster.dsn_for(name)
    # The cluster may have failed over meanwhile: wait for a primary, then drop (best effort).
    for _ in range(100):
        try:
            conn = await asyncpg.connect(ha_cluster.dsn, timeout=5)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            await asyncio.sleep(0.2)
            continue
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()
        break
