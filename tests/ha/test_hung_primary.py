"""A hung PostgreSQL leader (SIGSTOP of its Patroni and PostgreSQL, not a kill), listed first in the DSN.

A frozen host accepts TCP connections (its kernel's listen backlog) and never answers. asyncpg alone tries
a DSN's hosts in order under one shared timeout, so with the frozen leader first the workers never reached
the new leader Patroni promoted: every request for a tag with empty buffers answered `unavailable` until
the host was resumed (issue 22). When the frozen leader wakes up it is a zombie: it still believes it is
the primary until its Patroni sees the lost leader lock and demotes it; strict synchronous replication
fences it meanwhile, since no standby follows it any more and no commit there can complete.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from typing import Any

import asyncpg
import msgspec
import pytest

from dispenser_lab.servers import NatsServer, frozen
from dispenser_lab.servers.patroni import PatroniCluster, PatroniNode
from tests.integration.segment_support import prepare, running_worker, worker_config

from .load_support import LoadResult, load, until

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.nats, pytest.mark.ha, pytest.mark.slow]

# What a worker's fetch runs (adapters/postgres/segments.py), so that the zombie is asked for a grant the
# way a worker would ask.
_GRANT = "UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = $1 RETURNING max_id"


def leader_first(cluster: PatroniCluster, dsn: str, leader: PatroniNode) -> str:
    """``dsn``'s database, every node named, ``leader`` first (the order that used to hide a failover)."""
    ports = [leader.port] + [node.port for node in cluster.nodes if node is not leader]
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    database = urllib.parse.urlsplit(dsn).path.lstrip("/")
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"


def writable_leader_other_than(cluster: PatroniCluster, old: PatroniNode, timeout: float) -> PatroniNode:
    """Wait until another node leads with a writable PostgreSQL; the frozen one is not asked (it would not answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            if node is old or not node.running:
                continue
            if node.api("/primary")[0] == 200 and node.sql("SELECT pg_is_in_recovery()") == "f":
                return node
        time.sleep(0.05)
    raise AssertionError(f"no leader other than {old.name} within {timeout:g} s")


def answered_after(result: LoadResult, moment: float) -> int:
    """Requests answered with IDs that were sent after ``moment`` (monotonic seconds)."""
    return sum(1 for per in result.successes for s in per if s.sent > moment)


async def test_leader_frozen_first_in_the_dsn_fails_over_and_the_zombie_grants_nothing(
    ha_cluster: PatroniCluster, ha_dsn: str, nats_server: NatsServer
) -> None:
    """`unavailable` (for the tag that ran dry) stops within Patroni's failover time + 5 s; never while buffered.

    ``buffered`` holds segments far larger than the load takes meanwhile; ``dry`` has 50-ID segments and
    needs the store all the time. A connection a worker had opened to the leader before it froze then asks
    the woken zombie for a segment: it gets none (strict sync), and no ID is handed out twice.
    """
    old = ha_cluster.leader()
    assert old is not None
    assert old.pid is not None
    dsn = leader_first(ha_cluster, ha_dsn, old)
    await prepare(dsn, [("buffered", 5_000_000), ("dry", 50)])
    config = worker_config(nats_server.url, dsn, fetch_deadline=1.0)
    # Segments of the configured size, so that `dry` does run dry (the adaptive step would grow them).
    config = msgspec.structs.replace(config, rate=msgspec.structs.replace(config.rate, adaptive_step=False))
    url = [nats_server.url]
    zombie = await asyncpg.connect(old.dsn_for(urllib.parse.urlsplit(dsn).path.lstrip("/")), timeout=10)
    zombie_grant: asyncio.Task[Any] | None = None
    try:
        async with (
            running_worker(config),
            load([url, url], ["leaf.segment.buffered"], timeout=3.0) as buffered,
            load([url, url], ["leaf.segment.dry"], timeout=3.0) as dry,
        ):
            await until(lambda: dry.answered() > 100 and buffered.answered() > 100, 30, "load running")
            postmaster = old.postmaster()
            assert postmaster is not None
            with frozen(old.pid, postmaster[0]):
                frozen_at = time.monotonic()
                new = await asyncio.to_thread(writable_leader_other_than, ha_cluster, old, 60.0)
                elected_at = time.monotonic()
                await until(
                    lambda: answered_after(dry, elected_at) > 100, 30, "dry served from the new leader"
                )
                # Sent while frozen (the kernel buffers it): the zombie's backend runs it the moment it wakes,
                # before its Patroni has had a chance to demote it.
                zombie_grant = asyncio.create_task(zombie.fetchval(_GRANT, "dry", timeout=30))
                await asyncio.sleep(0)  # one loop turn: the task writes its query to the socket
            woke_at = time.monotonic()
            outcome = (await asyncio.gather(zombie_grant, return_exceptions=True))[0]
            zombie_done = time.monotonic() - woke_at
            # The fleet kept serving while the zombie was up: asked after it woke, answered.
            await until(lambda: answered_after(dry, woke_at) > 100, 30, "dry served after the zombie woke")
            buffered_stall = buffered.stall(frozen_at)
    finally:
        zombie.terminate()

    failover = elected_at - frozen_at
    unavailable = [at for at, code in dry.errors_at if code == "unavailable" and at > frozen_at]
    last = max(unavailable, default=frozen_at) - frozen_at
    first = min(s.at for per in dry.successes for s in per if s.sent > elected_at) - frozen_at
    print(
        f"\nfrozen {old.name} (first in the DSN) -> {new.name}: leader after {failover:.1f} s; dry-tag "
        f"'unavailable' {len(unavailable)} times, the last {last:.1f} s after the freeze; first new answer "
        f"{first:.1f} s; buffered stall {buffered_stall:.3f} s; zombie's grant: "
        f"{type(outcome).__name__} after {zombie_done:.1f} s"
    )
    # The zombie granted nothing: its commit could not reach a synchronous standby (strict mode), so the
    # statement ended in an error (demoted, shut down, or timed out), never with a max_id.
    assert isinstance(outcome, BaseException), f"the zombie granted max_id {outcome}"
    assert dry.duplicates() == 0, "a dry-tag ID was handed out twice"
    assert buffered.duplicates() == 0, "a buffered-tag ID was handed out twice"
    # The tag holding IDs noticed nothing.
    assert not buffered.errors
    assert not buffered.timeouts
    assert buffered_stall < 1.0, buffered_stall
    # The dry one: only the coded, retryable answer, within its deadline, and not past failover + 5 s.
    assert set(dry.errors) <= {"unavailable"}, dry.errors
    assert not dry.not_retryable
    assert not dry.timeouts
    assert last <= failover + 5.0, (last, failover)
