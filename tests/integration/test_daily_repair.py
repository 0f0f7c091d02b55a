"""A daily tag's day row lost whole in a failover comes back from the remembered grants (real PostgreSQL).

As in test_primary_repair.py, the lossy failover is played by hand: the row removed without a trace (its
INSERT never reached the promoted replica, so no tombstone either) and the worker's memory naming another
primary of the same cluster.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.daily import DailyPolicy

pytestmark = [pytest.mark.postgres]


async def test_a_day_row_lost_in_a_failover_is_opened_again_at_its_remembered_grant(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The repair recreates it where this worker left it: a worker without that memory then opens no day at 1."""
    await migrate(pg_dsn)
    grants = GrantFile.open(tmp_path / "state")
    try:
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            await store.add_tag("order", 10, daily=DailyPolicy.checked(6, "UTC"))
            for _ in range(3):
                await store.next_segment("order@20261128")
            assert store.watch is not None
            cluster = store.watch.cluster
            assert cluster is not None
            assert await grants.remembered(cluster) == {"order@20261128": 31}
            primary = grants.server(cluster)
            assert primary is not None
        conn = await asyncpg.connect(pg_dsn)
        try:  # lost whole: no trigger leaves a tombstone
            await conn.execute("SET session_replication_role = replica")
            await conn.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'order@20261128'")
        finally:
            await conn.close()
        await grants.set_server(cluster, f"{primary.partition('/')[0]}/0")  # a successor: a failover
        async with await PostgresSegmentStore.connect(pg_dsn, grants=grants) as store:
            await store.list_tags()  # connected: repaired
        async with await PostgresSegmentStore.connect(pg_dsn) as other:  # a worker with no memory of it
            assert (await other.next_segment("order@20261128")).segment.first == 31
    finally:
        grants.close()
