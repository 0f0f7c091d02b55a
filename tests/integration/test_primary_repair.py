"""Remembered grants restored on a primary that lost them, on a real PostgreSQL (no cluster needed).

A promoted replica that missed the last ``max_id`` updates is played here by rolling ``max_id`` back by
hand and making the worker's memory name another primary: what the store then does on its next connection
is exactly what it does after a lossy failover (tests/ha/test_async_hole.py does the real one).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable
from dispenser.testing.servers import NatsServer, PostgresServer, free_port
from tests.integration.segment_support import ask, client, prepare, running_worker, worker_config

pytestmark = [pytest.mark.postgres]


async def rewind(dsn: str, tag: str, max_id: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE leaf_alloc SET max_id = $2 WHERE biz_tag = $1", tag, max_id)
    finally:
        await conn.close()


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
            database = store.watch.database
            assert database is not None
            assert grants.remembered(database) == {"order": 301}
            this_primary = grants.server(database)
            assert this_primary is not None
        # The same primary again: nothing to repair, whatever the table says.
        await rewind(pg_dsn, "order", 201)
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            assert (await store.next_segment("order")).segment.first == 201
        # A primary this worker has not seen (after a failover): the lost grants come back first.
        await rewind(pg_dsn, "order", 101)
        await grants.set_server(database, "other-system/7")
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            after = await store.next_segment("order")
            assert after.segment.first == 301  # not 101: [101, 300] was granted before
            assert (await store.next_segment("user")).segment.first == 1  # never granted: untouched
        assert "raised max_id of 'order' to 301" in caplog.text
        assert grants.server(database) == this_primary
    finally:
        grants.close()


async def test_a_restarted_worker_remembers_from_its_state_directory(pg_dsn: str, tmp_path: Path) -> None:
    await migrate(pg_dsn)
    first = GrantFile.open(tmp_path / "state")
    async with await PostgresSegmentStore.connect(pg_dsn, grants=first) as store:
        await store.add_tag("order", 50)
        await store.next_segment("order")
        database = store.watch.database if store.watch else None
    first.close()
    assert database is not None
    await rewind(pg_dsn, "order", 1)
    restarted = GrantFile.open(tmp_path / "state")  # a new process: only the file knows
    await restarted.set_server(database, "other-system/2")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=restarted) as store:
            assert (await store.next_segment("order")).segment.first == 51
    finally:
        restarted.close()


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
        assert worker.postgres is not None
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
