"""Remembered grants restored on a primary that lost them, on a real PostgreSQL (no cluster needed).

A promoted replica that missed the last ``max_id`` updates is played here by rolling ``max_id`` back by
hand and making the worker's memory name another primary: what the store then does on its next connection
is exactly what it does after a lossy failover (tests/ha/test_async_hole.py does the real one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.postgres.primary import PrimaryWatch
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable
from dispenser_lab.servers import NatsServer, PostgresServer, free_port
from tests.integration.segment_support import ask, client, prepare, rewind, running_worker, worker_config

pytestmark = [pytest.mark.postgres]


async def test_a_new_primary_gets_the_remembered_grants_back_before_any_fetch(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "state")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            await store.add_tag("order", 100)
            await store.add_tag("user", 100)
            granted = [await store.next_segment("order") for _ in range(3)]
            assert granted[-1].segment.last == 300
            assert store.watch is not None
            cluster = store.watch.cluster
            assert cluster is not None
            assert await grants.remembered(cluster) == {"order": 301}
            this_primary = grants.server(cluster)
            assert this_primary is not None
            system = this_primary.partition("/")[0]
        # The same primary again, holding less than was granted on it (a restored snapshot, issue 29
        # item 1): raised too (before, nothing was repaired and [201, 300] went out again).
        await rewind(pg_dsn, "order", 201)
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            assert (await store.next_segment("order")).segment.first == 301
        # A successor of the primary it used (same system, an earlier timeline there: so after a
        # failover): the lost grants come back first.
        await rewind(pg_dsn, "order", 101)
        await grants.set_server(cluster, f"{system}/0")
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            after = await store.next_segment("order")
            assert after.segment.first == 401  # not 101: [101, 400] was granted before
            assert (await store.next_segment("user")).segment.first == 1  # never granted: untouched
        assert "restored from a snapshot or a backup?): raised max_id of 'order' to 301" in caplog.text
        assert "raised max_id of 'order' to 401" in caplog.text
        assert "granted on its predecessor (same system, timeline 0" in caplog.text
        assert grants.server(cluster) == this_primary
    finally:
        grants.close()


async def test_a_restarted_worker_remembers_from_its_state_directory(pg_dsn: str, tmp_path: Path) -> None:
    await migrate(pg_dsn)
    first = GrantFile.open(tmp_path / "state")
    async with await PostgresSegmentStore.connect(pg_dsn, grants=first) as store:
        await store.add_tag("order", 50)
        await store.next_segment("order")
        cluster = store.watch.cluster if store.watch else None
    first.close()
    assert cluster is not None
    await rewind(pg_dsn, "order", 1)
    restarted = GrantFile.open(tmp_path / "state")  # a new process: only the file knows
    await restarted.set_server(cluster, f"{cluster.partition('/')[0]}/0")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=restarted) as store:
            assert (await store.next_segment("order")).segment.first == 51
    finally:
        restarted.close()


async def test_a_first_connection_waits_the_grace_only_on_a_timeline_its_memory_has_not_seen(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 22 item 10: a restart or scale-out during a failover holds back like a worker that saw it.

    Before, only a primary change seen within one run waited ``new_primary_grace``: a process's first
    connection fetched at once, possibly before live peers on other hosts had repaired the new primary.
    The grace cases use 0.5 s and assert at least that; the no-grace cases use 30 s and assert far less, so
    no timing margin decides the outcome.
    """
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as admin:
        await admin.add_tag("order", 100)

    async def first_fetch(grants: GrantFile, grace: float) -> float:
        started = time.monotonic()
        async with await PostgresSegmentStore.connect(
            pg_dsn, grants=grants, new_primary_grace=grace
        ) as store:
            await store.next_segment("order")
        return time.monotonic() - started

    grants = GrantFile.open(tmp_path / "state")
    try:
        # A fresh memory on timeline 1 (the test server's): no promotion ever, nothing to wait for.
        assert await first_fetch(grants, 30.0) < 15.0
        system = await system_of(pg_dsn)
        cluster = f"{system}/{pg_dsn.rpartition('/')[2]}"
        server = grants.server(cluster)
        assert server is not None
        timeline = server.partition("/")[2]
        # A restart onto the primary it last used: no grace.
        assert await first_fetch(grants, 30.0) < 15.0
        assert "first fetch held back" not in caplog.text
        # A restart onto a later timeline than its memory's (played by an earlier one remembered): the grace.
        await grants.set_server(cluster, f"{system}/{int(timeline) - 1}")
        assert await first_fetch(grants, 0.5) >= 0.5
        assert (
            f"timeline this worker has not used (last: {system}/{int(timeline) - 1}): first fetch held"
            in caplog.text
        )
        # A new worker (no memory of the cluster) reaching a primary that was promoted once at least.
        fresh = GrantFile.open(tmp_path / "fresh")
        try:
            watch = PrimaryWatch("test", fresh)
            assert watch._unseen_timeline(cluster, f"{system}/2")
            assert not watch._unseen_timeline(cluster, f"{system}/1")
        finally:
            fresh.close()
    finally:
        grants.close()


async def system_of(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        system: str = await conn.fetchval("SELECT system_identifier::text FROM pg_control_system()")
        return system
    finally:
        await conn.close()


async def test_a_primary_reached_on_an_open_connection_is_repaired_before_its_segment_goes_out(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 22 item 10: a pooler (PgBouncer) keeps the client socket across a failover, so no new connection.

    The new primary is then seen only by what the fetch itself returns (its system identifier and timeline):
    played here by making the watch and the memory name an earlier timeline of the same system while the
    pool's connection stays open, and rolling ``max_id`` back as a lossy promotion would.
    """
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "state")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants, max_size=1) as store:
            await store.add_tag("order", 100)
            for _ in range(3):
                await store.next_segment("order")
            watch = store.watch
            assert watch is not None
            assert watch.cluster is not None
            assert watch.primary is not None
            system, _, timeline = watch.primary.partition("/")
            earlier = f"{system}/{int(timeline) - 1}"
            await rewind(pg_dsn, "order", 101)
            await grants.set_server(watch.cluster, earlier)
            watch.primary = earlier
            # The open connection now "reaches" a primary this worker never checked.
            # Not 101: [101, 300] went out. The first fetch already raised the row to this worker's floor
            # (301) and took [301, 400]; reaching an unchecked primary, it skipped that range (a gap).
            assert (await store.next_segment("order")).segment.first == 401
            assert watch.primary == f"{system}/{timeline}"
        assert "segment of 'order' ending at 401 skipped, primary repaired first" in caplog.text
    finally:
        grants.close()


async def test_grants_of_one_cluster_are_never_repaired_into_another(
    pg_dsn: str, private_postgres: PostgresServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state directory that served a tag on cluster 1, pointed at a fresh cluster 2 with the same tag: it starts at 1.

    Before, grants were keyed by database name: the worker "repaired" the new cluster from the old one's
    grants, and its first ID was that cluster's high water, not 1. Two servers initialised apart have
    different system identifiers, as two clusters do; a failover keeps it.
    """
    database = pg_dsn.rpartition("/")[2]
    other = private_postgres.create_database(database)  # the same database name on another cluster
    await migrate(pg_dsn)
    await migrate(other)
    grants = GrantFile.open(tmp_path / "state")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            await store.add_tag("order", 100)
            for _ in range(5):
                await store.next_segment("order")
            first = store.watch.cluster if store.watch else None
        async with await PostgresSegmentStore.connect(other) as admin:  # `tag add` on the new cluster
            await admin.add_tag("order", 100)
        async with await PostgresSegmentStore.connect(other, grants=grants) as store:
            assert (await store.next_segment("order")).segment.first == 1
            second = store.watch.cluster if store.watch else None
        assert first is not None
        assert second is not None
        assert first != second
        assert first.endswith(f"/{database}")
        assert second.endswith(f"/{database}")
        assert await grants.remembered(first) == {"order": 501}
        assert await grants.remembered(second) == {"order": 101}
        assert "raised max_id" not in caplog.text
    finally:
        grants.close()


async def test_no_primary_among_several_hosts_is_said_plainly() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/db?target_session_attrs=read-write"
    with pytest.raises(StoreUnavailable, match=r"no primary among the DSN's 2 hosts") as caught:
        await PostgresSegmentStore.connect(dsn, connect_timeout=2)
    assert caught.value.retryable
    assert caught.value.code == "unavailable"


@pytest.mark.nats
async def test_a_worker_started_without_postgres_answers_unavailable_then_serves(
    private_postgres: PostgresServer, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No primary at start (a failover, a cluster still electing): one warning, coded answers, then IDs."""
    await prepare(private_postgres.dsn, [("order", 100)])
    await asyncio.to_thread(private_postgres.stop)
    config = worker_config(nats_server.url, private_postgres.dsn, fetch_deadline=0.5)
    caplog.clear()
    async with running_worker(config) as worker, client(nats_server.url) as nc:
        assert not worker.postgres.connected
        reply = await ask(nc, "leaf.segment.order")
        assert reply.error is not None
        assert (reply.error.code, reply.error.retryable) == ("unavailable", True)
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(loud) == 1, [r.getMessage() for r in loud]
        assert "PostgreSQL cannot be reached yet, serving anyway" in loud[0].getMessage()
        await asyncio.to_thread(private_postgres.start)
        for _ in range(100):  # unknown tags are looked up at most once a second
            reply = await ask(nc, "leaf.segment.order")
            if reply.error is None:
                break
            await asyncio.sleep(0.2)
        assert reply.ids == [1]
        assert worker.postgres.connected
