"""Datacenter A lost under load: B's worker goes on (its buffers, then the promoted member in B), no ID twice.

The topology of docs/datacenters.md ("PostgreSQL across datacenters"): a Patroni cluster with the primary and
one replica in A and one replica in B, both replicas synchronous (``synchronous_node_count: 2``), and a
ZooKeeper ensemble of one server per site: A, B and a third site C, the tie-breaker without which B could
not promote. NATS: a server per datacenter joined by gateways. A worker in each datacenter; requesters in
both, those in A on A's NATS server, which stays up ("callers in A that still reach NATS").

Killed at once with SIGKILL: A's two Patroni members (and their PostgreSQL), A's ZooKeeper server and A's
worker. Not modelled: latency between the sites (loopback).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import msgspec
import pytest

from dispenser_lab.servers import NatsGateways
from dispenser_lab.servers.patroni import PatroniCluster, PatroniNode
from dispenser_lab.servers.zookeeper_ensemble import ZooKeeperEnsemble
from tests.integration.segment_support import (
    WorkerProcess,
    client,
    prepare,
    running_worker,
    worker_config,
)

from .load_support import LoadResult, load, until

# 30-80 s on the shared 2-core machine (a Patroni cluster and a ZooKeeper ensemble of its own, a failover):
# too long for the 4-minute suite, so it runs in CI's soak stage (`.ci/run`: -m 'soak and not manual').
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.zookeeper,
    pytest.mark.nats,
    pytest.mark.ha,
    pytest.mark.slow,
    pytest.mark.soak,
]


def _answered_after(result: LoadResult, moment: float, subject_prefix: str = "") -> int:
    return sum(
        1 for per in result.successes for s in per if s.at > moment and s.subject.startswith(subject_prefix)
    )


def _stall(result: LoadResult, requester: int, at: float) -> float:
    """The longest wait of one requester, around ``at``, between two answered requests."""
    times = [s.at for s in result.successes[requester]]
    before = [t for t in times if t <= at]
    after = [t for t in times if t > at]
    assert before, requester
    assert after, requester
    return after[0] - before[-1]


def _sync_standbys(cluster: PatroniCluster) -> set[str]:
    return {m.name for m in cluster.members() if m.role == "sync_standby" and m.state == "streaming"}


async def _database(cluster: PatroniCluster, name: str) -> str:
    conn = await asyncpg.connect(cluster.dsn, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return cluster.dsn_for(name)


async def test_datacenter_a_lost_b_promotes_and_serves(tmp_path: Path) -> None:
    """A's members, ZooKeeper server and worker killed: B serves A's callers too, from buffers then from B's new primary."""
    # Sessions capped at 6 s: a dead leader's lock expires in ~6 s (docs/ha.md).
    ensemble = ZooKeeperEnsemble(
        tmp_path / "zk", tick_time_ms=500, min_session_timeout_ms=1000, max_session_timeout_ms=6000
    )
    # Member 1 is A's ZooKeeper, 2 is B's, 3 the third site's.
    cluster = PatroniCluster(tmp_path / "pg", zookeeper_hosts=ensemble.hosts, synchronous="sync")
    nats_dcs = NatsGateways(tmp_path / "nats", ("dc-a", "dc-b"))
    a_worker: WorkerProcess | None = None
    with ensemble, nats_dcs:
        try:
            await asyncio.to_thread(cluster.start)
            a1 = cluster.wait_healthy()
            status, body = a1.api("/config", method="PATCH", body={"synchronous_node_count": 2})
            assert status == 200, body
            await until(lambda: len(_sync_standbys(cluster)) == 2, 60, "both replicas synchronous")
            a2, b1 = (n for n in cluster.nodes if n is not a1)
            dsn = await _database(cluster, "dcloss")
            await until(
                lambda: all(
                    n.sql("SELECT 1 FROM pg_database WHERE datname = 'dcloss'") == "1" for n in cluster.nodes
                ),
                30,
                "the database on every member",
            )
            await prepare(dsn, [("buffered", 5_000_000), ("dry", 50)])

            url_a, url_b = nats_dcs.url_of("dc-a"), nats_dcs.url_of("dc-b")
            # Each datacenter's worker remembers its grants in a state directory of its own (another host):
            # A's grants are on B's new primary only if replication put them there.
            env = {
                "DISPENSER_RATE_ADAPTIVE_STEP": "false",
                "DISPENSER_SEGMENT_FETCH_DEADLINE": "0.5",
                "DISPENSER_SEGMENT_STATE_DIR": str(tmp_path / "state-a"),
            }
            a_worker = WorkerProcess(url_a, dsn, tmp_path / "worker-a.log", **env)
            a_worker.start()
            config = worker_config(url_b, dsn, fetch_deadline=0.5, state_dir=tmp_path / "state-b")
            # Segments of the configured size, so that `dry` does run dry and must fetch from B's new primary.
            config = msgspec.structs.replace(
                config, rate=msgspec.structs.replace(config.rate, adaptive_step=False)
            )
            async with client(url_a) as probe:
                await a_worker.wait_ready(probe, "leaf.segment.buffered")
            subjects = ["leaf.segment.buffered", "leaf.segment.dry"]
            async with (
                running_worker(config) as b_worker,
                # One requester per (datacenter, subject): 0, 1 in A; 2, 3 in B.
                load(
                    [[url_a], [url_a], [url_b], [url_b]], subjects, timeout=1.0, one_subject_each=True
                ) as seen,
            ):
                await until(lambda: seen.answered() > 400, 30, "load running in both datacenters")
                killed_at = time.monotonic()
                assert a_worker.proc is not None
                a_worker.proc.kill()
                await asyncio.gather(
                    asyncio.to_thread(a1.kill),
                    asyncio.to_thread(a2.kill),
                    asyncio.to_thread(ensemble.member(1).kill),
                )
                new: PatroniNode = await asyncio.to_thread(cluster.wait_leader, other_than=a1, timeout=60)
                promoted_at = time.monotonic()
                await until(
                    lambda: _answered_after(seen, promoted_at + 3, "leaf.segment.dry") > 20,
                    60,
                    "dry served by B's new primary",
                )
                allocator = b_worker.allocator
                await until(lambda: allocator.tags["dry"].last_error is None, 30, "dry recovered in B")
                stall_a, stall_b = _stall(seen, 0, killed_at), _stall(seen, 2, killed_at)
        finally:
            if a_worker is not None:
                a_worker.stop()
            cluster.stop()

    a_callers = [s for n in (0, 1) for s in seen.successes[n] if s.at > promoted_at]
    dry_again = min(s.at for n in (1, 3) for s in seen.successes[n] if s.sent > promoted_at) - killed_at
    print(
        f"\nA lost: {new.name} (B) writable {promoted_at - killed_at:.1f} s after the kill; buffered tag's "
        f"longest wait: a caller in A {stall_a:.2f} s, in B {stall_b:.2f} s; dry (50-ID segments): {seen.errors['unavailable']} unavailable, served "
        f"again {dry_again:.1f} s after the kill; A's callers answered {len(a_callers)} times after the promotion; {len(seen.ids)} IDs; "
        f"{len(seen.timeouts)} request timeouts"
    )
    assert new is b1
    for subject in subjects:  # each tag has a sequence of its own: IDs are unique per tag
        ids = [
            i for per in seen.successes for success in per if success.subject == subject for i in success.ids
        ]
        assert len(ids) == len(set(ids)), f"{subject}: {len(ids) - len(set(ids))} IDs handed out twice"
    assert not seen.malformed
    assert set(seen.errors) <= {"unavailable"}, seen.errors
    assert not seen.not_retryable
    assert a_callers, "A's callers were not served from B"
    # B's caller of the buffered tag never noticed (its worker's buffers); A's lost at most the requests in
    # flight to A's worker (one 1 s timeout each) before the gateway sent them to B.
    assert stall_b < 1.0, stall_b
    assert stall_a < 3.0, stall_a
