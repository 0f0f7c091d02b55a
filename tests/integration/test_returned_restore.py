"""Returned ranges and the grant memory (issue 31 item 4): the floor never refuses one, a restore never repeats one.

A returned range lies below the tag's ``max_id`` and below the floor of the worker that returned it: the
floor guards ``leaf_alloc``, and a returned range was granted but never handed out, so it is handed out
again. The worker that takes it remembers the row's ``seq``: a database restored from between the return
and the take (the row back) never hands it out a second time. A snapshot is ``CREATE DATABASE … TEMPLATE``
(the same cluster, as a volume snapshot), restored under the same name, as in ``test_grant_floor.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import UnknownTag
from dispenser.core.segment import Segment
from dispenser_lab.servers import PostgresServer
from tests.integration.test_grant_floor import restore, snapshot

pytestmark = [pytest.mark.postgres]


async def fetched(dsn: str, tmp_path: Path, state: str, tag: str, times: int = 1) -> list[Segment]:
    """A worker with the state directory ``state`` (a new process) fetches ``times`` segments."""
    grants = GrantFile.open(tmp_path / state)
    try:
        async with await PostgresSegmentStore.connect(dsn, grants=grants) as store:
            return [(await store.next_segment(tag)).segment for _ in range(times)]
    finally:
        grants.close()


async def returned_by(dsn: str, tmp_path: Path, state: str, tag: str, ranges: list[tuple[int, int]]) -> int:
    """The worker with ``state`` returns ``ranges`` of ``tag``."""
    grants = GrantFile.open(tmp_path / state)
    try:
        async with await PostgresSegmentStore.connect(dsn, grants=grants) as store:
            return await store.return_unused(tag, ranges, state)
    finally:
        grants.close()


async def test_the_floor_does_not_refuse_a_range_its_own_worker_returned(pg_dsn: str, tmp_path: Path) -> None:
    """Granted [1, 200] and remembering it, the worker returns [101, 200]; restarted, it gets [101, 200] back."""
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as admin:
        await admin.add_tag("order", 100)
    assert await fetched(pg_dsn, tmp_path, "a", "order", 2) == [Segment(1, 100), Segment(101, 200)]
    assert await returned_by(pg_dsn, tmp_path, "a", "order", [(101, 200)]) == 100
    assert await fetched(pg_dsn, tmp_path, "a", "order", 2) == [Segment(101, 200), Segment(201, 300)]


async def test_a_restore_from_between_return_and_take_does_not_hand_the_range_out_twice(
    pg_dsn: str, postgres_server: PostgresServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """[51, 100] returned, snapshot, taken by b, snapshot restored (the row is back): b's next connection drops it.

    Neither b nor a worker that remembers nothing gets [51, 100] again.
    """
    database = pg_dsn.rpartition("/")[2]
    snap = "snap_" + database[-40:]
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as admin:
        await admin.add_tag("order", 100)
    assert await fetched(pg_dsn, tmp_path, "a", "order") == [Segment(1, 100)]
    assert await returned_by(pg_dsn, tmp_path, "a", "order", [(51, 100)]) == 50
    snapshot(postgres_server, database, snap)
    assert await fetched(pg_dsn, tmp_path, "b", "order") == [Segment(51, 100)]
    restore(postgres_server, database, snap)
    assert await fetched(pg_dsn, tmp_path, "b", "order") == [Segment(101, 200)]
    assert await fetched(pg_dsn, tmp_path, "c", "order") == [Segment(201, 300)]
    assert "dropped 'order' 51-100, never handed out again" in caplog.text


async def test_a_range_back_behind_the_takers_open_connection_is_dropped_by_its_fetch(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The row put back by hand behind b's pooled connection (no new connection): b's next fetch drops it."""
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "b")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants, max_size=1) as store:
            await store.add_tag("order", 100)
            await store.next_segment("order")
            assert await store.return_unused("order", [(51, 100)], "a") == 50
            conn = await asyncpg.connect(pg_dsn)
            try:
                [row] = await conn.fetch("SELECT * FROM dispenser_returned_range")
                assert (await store.next_segment("order")).segment == Segment(51, 100)
                await conn.execute(
                    "INSERT INTO dispenser_returned_range (seq, biz_tag, first_id, last_id, worker) "
                    "VALUES ($1, 'order', 51, 100, 'a')",
                    row["seq"],
                )
                assert (await store.next_segment("order")).segment == Segment(101, 200)
                assert await conn.fetchval("SELECT count(*) FROM dispenser_returned_range") == 0
            finally:
                await conn.close()
    finally:
        grants.close()


async def test_a_fetch_and_a_remove_of_the_tag_take_turns_without_a_deadlock(pg_dsn: str) -> None:
    """A remove holding the tag's row, a fetch behind it with a returned range waiting: the remove goes through.

    The fetch locks the tag's row before the returned range, as the remove does (its trigger deletes the
    range after the row): before, the fetch held the range and waited for the row while the remove held the
    row and waited for the range, and PostgreSQL broke the deadlock by failing one of them.
    """
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("order", 100)
        await store.next_segment("order")
        await store.next_segment("order")
        assert await store.return_unused("order", [(1, 100)], "a") == 100
        remover = await asyncpg.connect(pg_dsn)
        try:
            async with remover.transaction():
                await remover.execute("SELECT 1 FROM leaf_alloc WHERE biz_tag = 'order' FOR UPDATE")
                fetching = asyncio.create_task(store.next_segment("order", above=200))
                for _ in range(500):  # until the fetch waits for the remover
                    waiting = "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"
                    if await remover.fetchval(waiting):
                        break
                    await asyncio.sleep(0.01)  # paces the polling of pg_locks
                await remover.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'order'")
            with pytest.raises(UnknownTag):
                await fetching
        finally:
            await remover.close()
