"""Issue 29 items 1 and 2: a worker's floor is in every fetch, and the new-primary grace is the pool's.

A database restored from a snapshot keeps its cluster's identity (system identifier and, unless promoted,
timeline), so no identity check can see it; a PITR restored without the archive's later history files is on
an earlier timeline than the worker's memory. Both are played on the kit's real PostgreSQL: a snapshot is
``CREATE DATABASE … TEMPLATE`` (the same cluster, as a volume snapshot), restored under the same name.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable
from dispenser_lab.servers import PostgresServer
from tests.integration.segment_support import rewind, wait_until

pytestmark = [pytest.mark.postgres]


def snapshot(server: PostgresServer, database: str, into: str) -> None:
    """A copy of ``database`` in the same cluster (its sessions must be closed: a template has none)."""
    server.psql(f'CREATE DATABASE "{into}" TEMPLATE "{database}"')


def restore(server: PostgresServer, database: str, snap: str) -> None:
    """``database`` replaced by the snapshot ``snap``, under its own name (its sessions are cut)."""
    server.drop_database(database)
    server.psql(f'CREATE DATABASE "{database}" TEMPLATE "{snap}"')
    server.drop_database(snap)


async def granted(dsn: str, tmp_path: Path, state: str, tag: str, times: int = 1) -> list[int]:
    """A worker with the state directory ``state`` (a restart: a new process) fetches ``times`` segments."""
    grants = GrantFile.open(tmp_path / state)
    try:
        async with await PostgresSegmentStore.connect(dsn, grants=grants) as store:
            return [(await store.next_segment(tag)).segment.first for _ in range(times)]
    finally:
        grants.close()


async def test_a_restored_snapshot_does_not_regrant_what_the_worker_remembers(
    pg_dsn: str, postgres_server: PostgresServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """[1, 100] granted, snapshot, [101, 400] granted, snapshot restored: the restarted worker's next is 401.

    Before, its first segment was [101, 200] again: the primary's (system identifier, timeline) had not
    changed, so nothing was repaired, and nothing was logged.
    """
    database = pg_dsn.rpartition("/")[2]
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as admin:
        await admin.add_tag("order", 100)
    assert await granted(pg_dsn, tmp_path, "state", "order") == [1]
    snapshot(postgres_server, database, "snap_" + database[-40:])
    assert await granted(pg_dsn, tmp_path, "state", "order", 3) == [101, 201, 301]
    restore(postgres_server, database, "snap_" + database[-40:])
    assert await granted(pg_dsn, tmp_path, "state", "order") == [401]
    # Its new connection raised the row too, so a worker that remembers nothing is above it as well.
    assert await granted(pg_dsn, tmp_path, "other", "order") == [501]
    assert "raised max_id of 'order' to 401" in caplog.text
    assert "restored from a snapshot or a backup?" in caplog.text


async def test_a_live_worker_keeps_its_floor_on_its_pooled_connection(pg_dsn: str, tmp_path: Path) -> None:
    """A row rewound behind the worker's open connection (no new connection, no identity check): 401, not 101.

    The floor goes with the fetch itself, in its one statement.
    """
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "state")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants, max_size=1) as store:
            await store.add_tag("order", 100)
            assert [(await store.next_segment("order")).segment.first for _ in range(4)] == [1, 101, 201, 301]
            await rewind(pg_dsn, "order", 101)
            assert (await store.next_segment("order")).segment.first == 401
    finally:
        grants.close()


async def test_after_a_restore_a_live_worker_sharing_the_state_directory_fetches_above_its_peers_grants(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Two workers, one state directory: b took [1, 100], a [101, 400]; a restore rewinds the row and cuts b's connection.

    b's next fetch opens a new connection, which restores every grant of the directory first (a's file
    included): b gets [401, 500], not [101, 200]. Before, the same primary was never repaired.
    """
    await migrate(pg_dsn)
    a_grants = GrantFile.open(tmp_path / "shared")
    b_grants = GrantFile.open(tmp_path / "shared")  # a second slot, a second file
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=b_grants, max_size=1) as b:
            await b.add_tag("order", 100)
            assert (await b.next_segment("order")).segment.first == 1
            async with await PostgresSegmentStore.connect(pg_dsn, grants=a_grants) as a:
                assert [(await a.next_segment("order")).segment.first for _ in range(3)] == [101, 201, 301]
            # The restore: the row back where the snapshot had it, every session of the database cut.
            conn = await asyncpg.connect(pg_dsn)
            try:
                await conn.execute("UPDATE leaf_alloc SET max_id = 101 WHERE biz_tag = 'order'")
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            finally:
                await conn.close()
            for _ in range(3):  # the first may find its connection cut (unavailable): the allocator retries
                try:
                    first = (await b.next_segment("order")).segment.first
                    break
                except StoreUnavailable:
                    continue
            assert first == 401
    finally:
        a_grants.close()
        b_grants.close()


async def test_a_pitr_on_an_earlier_timeline_does_not_regrant(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restore onto a timeline earlier than the memory's (a PITR without the later history files).

    Before, the timeline filter dropped every grant made on a later timeline than the restored primary's:
    nothing was repaired, and the worker's next segment was [101, 200] again.
    """
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "state")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            await store.add_tag("order", 100)
            assert [(await store.next_segment("order")).segment.first for _ in range(4)] == [1, 101, 201, 301]
            assert store.watch is not None
            cluster, primary = store.watch.cluster, store.watch.primary
        assert cluster is not None
        assert primary is not None
        system, _, timeline = primary.partition("/")
        # The memory says its grants were made on a later timeline of the same system than the one the
        # restored database is on, and the database lost them.
        await grants.set_server(cluster, f"{system}/{int(timeline) + 1}")
        await rewind(pg_dsn, "order", 101)
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            assert (await store.next_segment("order")).segment.first == 401
    finally:
        grants.close()
    assert "raised max_id of 'order' to 401" in caplog.text


class HeldClock:
    """A clock whose sleeps last until the test ends them: the grace ends when the test says so."""

    def __init__(self) -> None:
        self.sleepers = 0
        self.slept = 0
        self._over = asyncio.Event()

    def monotonic(self) -> float:
        return 1000.0 if not self._over.is_set() else 1e9

    def wall_ms(self) -> int:
        return 0

    async def sleep(self, seconds: float) -> None:
        self.sleepers += 1
        try:
            await self._over.wait()
        finally:
            self.sleepers -= 1
            self.slept += 1

    def end(self) -> None:
        self._over.set()


async def test_the_new_primary_grace_holds_every_connection_of_the_pool(pg_dsn: str, tmp_path: Path) -> None:
    """Pool of 2: while tag a's fetch waits out the grace on one connection, tag b's waits too on the other.

    Before, b's fetch went out at once (after 0.01 s, with a grace of 2 s): the grace held only the
    connection that had seen the new primary. Played as in test_primary_repair (a pooler that keeps the
    socket: the watch and the memory name an earlier timeline of the same system), on a clock the test
    ends the grace on, so no time is measured.
    """
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "state")
    clock = HeldClock()
    try:
        async with await PostgresSegmentStore.connect(
            pg_dsn, grants=grants, min_size=2, max_size=2, new_primary_grace=2.0, clock=clock
        ) as store:
            await store.add_tag("a", 100)
            await store.add_tag("b", 100)
            watch = store.watch
            assert watch is not None
            assert watch.cluster is not None
            assert watch.primary is not None
            system, _, timeline = watch.primary.partition("/")
            earlier = f"{system}/{int(timeline) - 1}"
            await grants.set_server(watch.cluster, earlier)
            watch.primary = earlier
            a = asyncio.create_task(store.next_segment("a"))
            await wait_until(
                lambda: clock.sleepers == 1, what="a's fetch saw the new primary and waits the grace"
            )
            b = asyncio.create_task(store.next_segment("b"))
            await wait_until(lambda: b.done() or clock.sleepers == 2, what="b's fetch waits or is done")
            assert not b.done(), "b's fetch went out before the grace ended"
            conn = await asyncpg.connect(pg_dsn)
            try:
                assert await conn.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = 'b'") == 1
            finally:
                await conn.close()
            clock.end()
            assert (await a).segment.first == 101  # [1, 100] was skipped: granted before the check
            assert (await b).segment.first == 1
    finally:
        grants.close()
