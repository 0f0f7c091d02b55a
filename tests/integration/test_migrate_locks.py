"""`dispenser migrate` behind a long transaction: a short lock timeout, retried, so fetches are never held long.

A DDL statement on leaf_alloc waits for every transaction that holds a lock on it, and every fetch that comes
after it waits behind it (PostgreSQL's lock queue). Without a lock timeout one long transaction froze the
fleet's fetches for as long as migrate's statement timeout (60 s): docs/segment.md ("The table").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeAlias

import asyncpg
import pytest

from dispenser.adapters.postgres.schema import LOCK_KEY, MIGRATIONS, migrate, schema_version
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.cli import main
from dispenser.core.errors import StoreUnavailable

from .segment_support import wait_until

pytestmark = pytest.mark.postgres

Connection: TypeAlias = "asyncpg.Connection[Any]"

BEFORE = tuple(m for m in MIGRATIONS if m.version < MIGRATIONS[-1].version)
"""Every migration but the last: the last one (version 6 and later) creates triggers on leaf_alloc."""

WAITING = "waits for a lock"


async def _hold_a_lock_on_leaf_alloc(dsn: str) -> Connection:
    """A session in a long transaction that wrote a row of leaf_alloc (ROW EXCLUSIVE until it ends)."""
    holder = await asyncpg.connect(dsn)
    await holder.execute("BEGIN")
    await holder.execute("UPDATE leaf_alloc SET step = step WHERE biz_tag = 'held'")
    return holder


def _lock_waits(caplog: pytest.LogCaptureFixture) -> int:
    return sum(WAITING in record.getMessage() for record in caplog.records)


async def test_a_fetch_is_not_held_behind_a_migrate_queued_on_a_long_transaction(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch completes while migrate still retries its lock; migrate succeeds once the transaction ends."""
    caplog.set_level(logging.WARNING, logger="dispenser.adapters.postgres.schema")
    await migrate(pg_dsn, migrations=BEFORE)
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("held", step=10)
        await store.add_tag("order", step=10)
        holder = await _hold_a_lock_on_leaf_alloc(pg_dsn)
        try:
            migrating = asyncio.ensure_future(migrate(pg_dsn, lock_timeout=0.2, lock_retry_for=30.0))
            await wait_until(lambda: _lock_waits(caplog) >= 1, what="migrate's first lock timeout")
            # Bounded only so that a fetch queued behind migrate for good fails instead of hanging the test.
            segment = await asyncio.wait_for(store.next_segment("order"), timeout=10)
            assert segment.segment.first == 1
            assert not migrating.done(), "the fetch completed while migrate was still retrying"
            await wait_until(lambda: _lock_waits(caplog) >= 2, what="migrate retrying")
        finally:
            await holder.execute("ROLLBACK")
            await holder.close()
        assert await migrating == [MIGRATIONS[-1].version]
    assert await schema_version(pg_dsn) == MIGRATIONS[-1].version


async def test_migrate_gives_up_with_a_clear_message_and_applies_nothing(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A transaction that outlasts lock_retry_for: StoreUnavailable naming the lock, the schema as it was."""
    caplog.set_level(logging.WARNING, logger="dispenser.adapters.postgres.schema")
    await migrate(pg_dsn, migrations=BEFORE)
    holder = await _hold_a_lock_on_leaf_alloc(pg_dsn)
    try:
        with pytest.raises(
            StoreUnavailable, match=r"could not take a lock on a table within 0\.1 s"
        ) as gave_up:
            await migrate(pg_dsn, lock_timeout=0.1, lock_retry_for=1.0)
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    assert gave_up.value.retryable
    assert "pg_stat_activity" in str(gave_up.value), "the message says where to find the blocker"
    assert _lock_waits(caplog) >= 2
    assert await schema_version(pg_dsn) == BEFORE[-1].version


async def test_dispenser_migrate_takes_its_lock_limits_from_the_command_line(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dispenser migrate --lock-timeout 0.1 --lock-retry-for 0.3` behind a long transaction: exit 1, one line."""
    await migrate(pg_dsn, migrations=BEFORE)
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    holder = await _hold_a_lock_on_leaf_alloc(pg_dsn)
    try:
        args = ["migrate", "--lock-timeout", "0.1", "--lock-retry-for", "0.3"]
        assert await asyncio.to_thread(main, args) == 1
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    assert "could not take a lock on a table within 0.1 s" in capsys.readouterr().err
    assert await asyncio.to_thread(main, ["migrate"]) == 0
    assert await schema_version(pg_dsn) == MIGRATIONS[-1].version


async def test_concurrent_migrates_still_wait_for_each_other_past_the_lock_timeout(pg_dsn: str) -> None:
    """The lock timeout is not on migrate's own advisory lock: a migrate behind another waits, then applies none."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)  # a migrate running
            waiting = asyncio.ensure_future(migrate(pg_dsn, lock_timeout=0.05, lock_retry_for=0.1))
            await asyncio.sleep(0.3)  # the window in which migrate must NOT give up (6 lock timeouts)
            assert not waiting.done()
        assert await waiting == [m.version for m in MIGRATIONS]
    finally:
        await conn.close()
