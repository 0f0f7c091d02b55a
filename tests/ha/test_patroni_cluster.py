"""The test kit's Patroni cluster: what the HA tests rely on, checked on the real thing."""

from __future__ import annotations

import asyncpg
import pytest

from dispenser_lab.servers.patroni import PatroniCluster

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.ha]


async def test_cluster_is_three_nodes_in_strict_synchronous_mode(ha_cluster: PatroniCluster) -> None:
    leader = ha_cluster.leader()
    assert leader is not None
    members = {m.name: m for m in ha_cluster.members()}
    assert sorted(members) == ["node1", "node2", "node3"]
    assert members[leader.name].role == "leader"
    assert sorted(m.role for m in members.values() if m.name != leader.name) == ["replica", "sync_standby"]
    conn = await asyncpg.connect(ha_cluster.dsn, timeout=10)
    try:
        # The multi-host DSN reaches the primary, which waits for a standby on every commit.
        assert await conn.fetchval("SELECT inet_server_port()") == leader.port
        assert not await conn.fetchval("SELECT pg_is_in_recovery()")
        assert await conn.fetchval("SHOW synchronous_standby_names") != ""
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
    finally:
        await conn.close()
    # What the async-hole test freezes: the leader streams to both replicas, each through one walsender.
    assert len(leader.wal_processes("walsender")) == 2
    for node in ha_cluster.nodes:
        if node is not leader:
            assert len(node.wal_processes("walreceiver")) == 1


async def test_standby_dsn_reaches_a_replica(ha_cluster: PatroniCluster) -> None:
    conn = await asyncpg.connect(ha_cluster.dsn_for("postgres", "standby"), timeout=10)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()")
    finally:
        await conn.close()
