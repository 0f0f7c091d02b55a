"""The asynchronous-replication hole, shown and closed: a promoted replica that lost granted segments.

With asynchronous replication the primary acknowledges an ``UPDATE … RETURNING max_id`` before any replica
has it. Here that window is held open on purpose: the primary's WAL senders are stopped (SIGSTOP), workers
fetch segments (committed on the primary only), the primary is killed (-9), and Patroni promotes a replica
that never saw those updates. The new primary would grant the same ranges again.

Why the senders and not the replicas' WAL receivers: a stopped receiver still lets the kernel queue the
sender's bytes in its socket, and those bytes are read and replayed after SIGCONT, before the failover (the
replica then loses nothing, as tried first). A stopped sender sends nothing.

Three workers on one cluster, each answering on its own subject prefix so the test chooses who fetches:
``a`` remembers its grants (the default), ``c`` does not (``segment.remember_grants = false``), ``b`` comes
after the failover with no memory. ``a`` fetches tag ``kept`` and ``c`` tag ``lost`` during the freeze;
after the failover ``a`` repairs the new primary on its first connection, ``c`` does not, then ``b`` takes
both tags: it repeats ``c``'s IDs of ``lost`` and none of ``a``'s IDs of ``kept``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from dispenser.app import Worker
from dispenser.cli import main
from dispenser.config import Config, load_config
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.patroni import PatroniCluster
from dispenser_lab.servers.process import sigstop
from tests.integration.segment_support import ask, client, ids_of, prepare, running_worker

from .load_support import until

# Fixtures are what pytest passes; there is no call site to keep short.
# ruff: noqa: PLR0917

pytestmark = [pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.nats, pytest.mark.ha, pytest.mark.slow]


def config(nats_url: str, dsn: str, prefix: str, state_dir: Path, *, remember: bool = True) -> Config:
    return load_config(
        environ={
            "DISPENSER_NATS_URL": nats_url,
            "DISPENSER_NATS_SUBJECT_PREFIX": prefix,
            "DISPENSER_NATS_QUEUE_GROUP": prefix,
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_SEGMENT_STATE_DIR": str(state_dir),
            "DISPENSER_SEGMENT_REMEMBER_GRANTS": str(remember).lower(),
            "DISPENSER_RATE_ENABLED": "false",
            "DISPENSER_RATE_ADAPTIVE_STEP": "false",  # segments of the configured 100 IDs
        }
    )


async def max_ids(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return {r["biz_tag"]: r["max_id"] for r in await conn.fetch("SELECT biz_tag, max_id FROM leaf_alloc")}
    finally:
        await conn.close()


async def take(nc: object, subject: str, count: int) -> list[int]:
    reply = await ask(nc, subject, f'{{"count": {count}, "format": "ranges"}}'.encode())  # type: ignore[arg-type]
    return ids_of(reply)


def grants_server(worker: Worker, database: str) -> str | None:
    """The primary ``worker`` last used for ``database`` (its grants are kept per cluster: system/database)."""
    assert worker.postgres.watch is not None
    cluster = worker.postgres.watch.cluster
    assert cluster is not None
    assert cluster.endswith(f"/{database}")
    return worker.grants.server(cluster)


async def test_async_failover_loses_grants_and_the_repair_restores_them(
    ha_cluster: PatroniCluster,
    ha_dsn: str,
    nats_server: NatsServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await asyncio.to_thread(ha_cluster.set_synchronous, "async")
    await prepare(ha_dsn, [("kept", 100), ("lost", 100)])
    database = ha_dsn.rpartition("/")[2].partition("?")[0]
    url = nats_server.url
    # `dispenser check` names the risk.
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", ha_dsn)
    monkeypatch.setenv("DISPENSER_NATS_URL", url)
    assert await asyncio.to_thread(main, ["check"]) == 0
    out = capsys.readouterr().out
    assert "replicating ASYNCHRONOUSLY to 2 standby(s)" in out
    assert "WARN postgres: a failover may promote a standby that lacks the last segment grants" in out
    assert "DUPLICATE IDs" in out
    async with (
        running_worker(config(url, ha_dsn, "a", tmp_path / "a")) as a,
        running_worker(config(url, ha_dsn, "c", tmp_path / "c", remember=False)),
        client(url) as nc,
    ):
        kept_before = await take(nc, "a.segment.kept", 1)
        lost_before = await take(nc, "c.segment.lost", 1)
        server_before = grants_server(a, database)
        assert server_before is not None
        leader = ha_cluster.leader()
        assert leader is not None
        replicas = [n for n in ha_cluster.nodes if n is not leader]
        # Every replica has replayed all so far; then the senders stop.
        await asyncio.to_thread(ha_cluster.wait_replayed)
        senders = leader.wal_processes("walsender")
        assert len(senders) == 2
        sigstop(*(pid for pid, _ in senders))
        try:
            # Several segments each, acknowledged by the primary alone.
            kept_before += await take(nc, "a.segment.kept", 450)
            lost_before += await take(nc, "c.segment.lost", 450)
            on_primary = await max_ids(ha_cluster.dsn_for(database))
            on_replica = await max_ids(replicas[0].dsn_for(database))
            assert on_replica["kept"] < on_primary["kept"], (on_replica, on_primary)
            assert on_replica["lost"] < on_primary["lost"], (on_replica, on_primary)
        finally:
            # SIGKILL reaches stopped processes: the whole tree goes, senders included.
            old = await asyncio.to_thread(ha_cluster.kill_leader)
        new = await asyncio.to_thread(ha_cluster.wait_leader, other_than=old)
        after = await max_ids(ha_cluster.dsn_for(database))
        # The hole: the new primary lacks what the old one granted (`kept` too, unless `a` repaired it
        # already: its heartbeat may be quicker than this query).
        assert after["lost"] < on_primary["lost"]

        # `a` holds IDs and needs no segment, yet its heartbeat connects to the new primary and repairs it;
        # `c` does not remember, and fetches as it is.
        await until(lambda: grants_server(a, database) not in (None, server_before), 30, "a repaired")
        assert (await max_ids(ha_cluster.dsn_for(database)))["kept"] >= on_primary["kept"]
        assert "raised max_id of 'kept'" in caplog.text
        kept_a_after = await take(nc, "a.segment.kept", 450)
        async with running_worker(config(url, ha_dsn, "b", tmp_path / "b", remember=False)):
            kept_b = await take(nc, "b.segment.kept", 300)
            # Few enough that the new primary's max_id stays under c's last grant (b fetches 3 segments
            # of 100: the next one at each switch), so that c's next fetch below lands in the hole.
            lost_b = await take(nc, "b.segment.lost", 150)
        # `c` itself refuses a segment below one it already holds: its tag stops rather than repeat, once
        # it has handed out what it holds.
        served_c: list[int] = []
        for _ in range(10):
            lost_c_after = await ask(nc, "c.segment.lost", b'{"count": 450, "format": "ranges"}')
            if lost_c_after.error is not None:
                break
            served_c += ids_of(lost_c_after)

    print(f"\nasync failover {old.name} -> {new.name}; max_id before {on_primary}, after {after}")
    kept = kept_before + kept_a_after + kept_b
    assert len(kept) == len(set(kept)), "the repaired tag repeated an ID"
    repeated = set(lost_before) & set(lost_b)
    assert repeated, "without the repair, the promoted replica should have granted c's IDs again"
    assert lost_c_after.error is not None, f"c kept serving: {len(served_c)} IDs after the failover"
    assert lost_c_after.error.code == "unavailable"
