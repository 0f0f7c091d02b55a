"""A tag's life cycle against concurrent writers of leaf_alloc: a remove held open, TRUNCATE, a rename.

Each test plays an operator's psql session with raw SQL on its own connection (an open transaction is what
psql leaves between statements), so the guarantees hold for every writer of ``leaf_alloc``, not only for
``dispenser tag``: docs/segment.md ("A tag's life cycle").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import asyncpg
import pytest

from dispenser.adapters.postgres.schema import MIGRATIONS, migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import TagStartTooLow
from dispenser.core.segment import Segment

pytestmark = pytest.mark.postgres

Connection: TypeAlias = "asyncpg.Connection[Any]"


@pytest.fixture
async def sessions(pg_dsn: str) -> AsyncIterator[Callable[[], Awaitable[Connection]]]:
    """Open psql-like sessions on a migrated database holding tag 'a' with IDs handed out up to 100."""
    await migrate(pg_dsn)
    opened: list[Connection] = []

    async def session() -> Connection:
        conn = await asyncpg.connect(pg_dsn)
        opened.append(conn)
        return conn

    admin = await session()
    await admin.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('a', 1, 100)")
    # Leaf's fetch: the segment [1, 100] is handed out, max_id is now 101.
    await admin.execute("UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = 'a'")
    yield session
    for conn in opened:
        await conn.close()


async def _blocked_on_a_lock(watcher: Connection, pid: int) -> None:
    """Return once the backend ``pid`` waits for a lock (its statement has reached the point of the race)."""
    for _ in range(500):
        wait = await watcher.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid)
        if wait == "Lock":
            return
        await asyncio.sleep(0.01)  # polling pg_stat_activity; bounded at 5 s by the loop
    raise AssertionError(f"backend {pid} never waited for a lock")


async def _raw_insert(conn: Connection, start: int) -> None:
    await conn.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('a', $1, 100)", start)


async def test_a_raw_insert_waits_for_a_remove_held_open_and_is_refused_below_its_high_water(
    sessions: Callable[[], Awaitable[Connection]],
) -> None:
    """psql: DELETE left uncommitted, then another session's INSERT at 1 waits for it and is refused.

    Before schema version 6 the INSERT's trigger read the tombstone table before the DELETE committed, saw
    nothing, then waited on the primary key and went in at 1: the next segment was [1, 100] again.
    """
    remover, adder, watcher = await sessions(), await sessions(), await sessions()
    async with remover.transaction():
        await remover.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'a'")
        insert = asyncio.ensure_future(_raw_insert(adder, 1))
        await _blocked_on_a_lock(watcher, adder.get_server_pid())
    with pytest.raises(asyncpg.CheckViolationError, match="start at 101 or above"):
        await insert
    assert await watcher.fetchval("SELECT count(*) FROM leaf_alloc") == 0


async def test_dispenser_tag_add_waits_for_a_remove_held_open_and_says_so(
    pg_dsn: str, sessions: Callable[[], Awaitable[Connection]]
) -> None:
    """`dispenser tag add a --start 1` (the store's add_tag) against a psql DELETE left open: TagStartTooLow."""
    remover, watcher = await sessions(), await sessions()
    async with await PostgresSegmentStore.connect(pg_dsn, min_size=1, max_size=1) as store:
        pid = await store.fetchrow("reading the pid", "SELECT pg_backend_pid() AS pid")
        assert pid is not None
        async with remover.transaction():
            await remover.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'a'")
            add = asyncio.ensure_future(store.add_tag("a", step=100, start=1))
            await _blocked_on_a_lock(watcher, pid["pid"])
        with pytest.raises(TagStartTooLow) as refused:
            await add
        assert refused.value.high_water == 101
        await store.add_tag("a", step=100, start=101)
        assert (await store.next_segment("a")).segment == Segment(101, 200)


async def test_a_repeatable_read_insert_whose_snapshot_predates_the_remove_must_retry(
    sessions: Callable[[], Awaitable[Connection]],
) -> None:
    """Under REPEATABLE READ the tombstone committed after the adder's snapshot is invisible: serialization failure.

    The retry (a new transaction, as for any serialization failure) sees the tombstone and is refused.
    """
    remover, adder = await sessions(), await sessions()
    async with adder.transaction(isolation="repeatable_read"):
        await adder.fetchval("SELECT count(*) FROM leaf_alloc")  # the snapshot is taken here
        await remover.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'a'")
        with pytest.raises(asyncpg.SerializationError):
            await _raw_insert(adder, 1)
    async with adder.transaction(isolation="repeatable_read"):
        with pytest.raises(asyncpg.CheckViolationError, match="start at 101 or above"):
            await _raw_insert(adder, 1)
    async with adder.transaction(isolation="serializable"):
        await _raw_insert(adder, 101)


async def test_truncate_keeps_every_tags_high_water(sessions: Callable[[], Awaitable[Connection]]) -> None:
    """TRUNCATE leaf_alloc records every row's max_id as a removal, so a re-add at 1 is refused."""
    admin = await sessions()
    await admin.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('b', 7, 100)")
    await admin.execute("TRUNCATE leaf_alloc")
    rows = await admin.fetch('SELECT biz_tag, max_id FROM dispenser_removed_tag ORDER BY biz_tag COLLATE "C"')
    assert [tuple(row) for row in rows] == [("a", 101), ("b", 7)]
    with pytest.raises(asyncpg.CheckViolationError, match="start at 101 or above"):
        await _raw_insert(admin, 1)


async def test_truncate_under_a_transaction_snapshot_is_refused(
    sessions: Callable[[], Awaitable[Connection]],
) -> None:
    """TRUNCATE under REPEATABLE READ could record a max_id older than the latest fetch: refused, nothing lost."""
    admin = await sessions()
    with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError, match="READ COMMITTED"):
        async with admin.transaction(isolation="repeatable_read"):
            await admin.execute("TRUNCATE leaf_alloc")
    assert await admin.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = 'a'") == 101


async def test_an_insert_behind_a_truncate_held_open_is_refused(
    sessions: Callable[[], Awaitable[Connection]],
) -> None:
    """A TRUNCATE left uncommitted: an INSERT at 1 waits for it, then sees its tombstones and is refused."""
    truncator, adder, watcher = await sessions(), await sessions(), await sessions()
    async with truncator.transaction():
        await truncator.execute("TRUNCATE leaf_alloc")
        insert = asyncio.ensure_future(_raw_insert(adder, 1))
        await _blocked_on_a_lock(watcher, adder.get_server_pid())
    with pytest.raises(asyncpg.CheckViolationError, match="start at 101 or above"):
        await insert


async def test_a_rename_is_a_remove_and_an_add(sessions: Callable[[], Awaitable[Connection]]) -> None:
    """UPDATE … SET biz_tag: the old name keeps its high water, and the new name's is checked."""
    admin = await sessions()
    await admin.execute("UPDATE leaf_alloc SET biz_tag = 'b' WHERE biz_tag = 'a'")
    assert await admin.fetchval("SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = 'a'") == 101
    with pytest.raises(asyncpg.CheckViolationError, match="start at 101 or above"):
        await _raw_insert(admin, 1)
    await admin.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('c', 1, 100)")
    with pytest.raises(asyncpg.CheckViolationError, match="start at 101 or above"):
        await admin.execute("UPDATE leaf_alloc SET biz_tag = 'a' WHERE biz_tag = 'c'")
    # A fetch (which never sets biz_tag) is untouched by the rename triggers.
    await admin.execute("UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = 'b'")
    assert await admin.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = 'b'") == 201


async def test_a_database_at_version_5_is_upgraded_and_its_tombstones_kept(pg_dsn: str) -> None:
    """A version-5 database: migrate applies version 6 and keeps the tombstones written before it."""
    before = tuple(m for m in MIGRATIONS if m.version <= 5)
    await migrate(pg_dsn, migrations=before)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('a', 501, 100)")
        await conn.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'a'")
        assert await migrate(pg_dsn) == [m.version for m in MIGRATIONS if m.version > 5]
        with pytest.raises(asyncpg.CheckViolationError, match="start at 501 or above"):
            await _raw_insert(conn, 1)
    finally:
        await conn.close()
