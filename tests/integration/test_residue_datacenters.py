"""A PostgreSQL per datacenter, a residue class each (docs/datacenters.md, topology 3), against real servers.

Two PostgreSQL servers (A's, B's) with no link between them, a NATS server per datacenter joined by
gateways, a worker in each datacenter on its own database: tag ``order`` has stride 2, offset 0 in A and
offset 1 in B. Callers in both datacenters draw IDs in both reply formats.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import msgspec
import pytest

from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.residue import Residue
from dispenser.messages import Reply
from dispenser_lab.servers import NatsGateways, PostgresServer
from tests.integration.segment_support import client, request, running_worker, worker_config

pytestmark = [pytest.mark.postgres, pytest.mark.nats]

STEP = 100


async def _prepare(dsn: str, offset: int) -> None:
    await migrate(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        await store.add_tag("order", STEP, residue=Residue(2, offset))
        await store.add_tag("plain", STEP)


async def _draw(url: str, tag: str) -> tuple[list[int], list[list[int]]]:
    """IDs of 30 requests in the ``ids`` format and 10 in ``ranges``, in the order received; and the ranges."""
    ids: list[int] = []
    ranges: list[list[int]] = []
    async with client(url) as nc:
        for n in range(40):
            body = b'{"count": 37}' if n % 4 else b'{"count": 50, "format": "ranges"}'
            reply = msgspec.json.decode((await request(nc, f"leaf.segment.{tag}", body)).data, type=Reply)
            assert reply.error is None, reply.error
            if reply.ranges is not None:
                ranges.extend([first, last] for first, last in reply.ranges)
                ids.extend(i for first, last in reply.ranges for i in range(first, last + 1))
            else:
                assert reply.ids is not None
                ids.extend(reply.ids)
    return ids, ranges


async def test_two_databases_two_classes_never_one_id(
    postgres_server: PostgresServer, private_postgres: PostgresServer, tmp_path: Path
) -> None:
    """A's IDs even, B's odd, each increasing; ranges come as one-ID ranges; a Leaf tag beside is unchanged."""
    dsn_a = postgres_server.create_database("residue_a")
    dsn_b = private_postgres.dsn
    try:
        await _prepare(dsn_a, 0)
        await _prepare(dsn_b, 1)
        with NatsGateways(tmp_path / "nats", ("dc-a", "dc-b")) as dcs:
            url_a, url_b = dcs.url_of("dc-a"), dcs.url_of("dc-b")
            configs = [worker_config(url, dsn) for url, dsn in ((url_a, dsn_a), (url_b, dsn_b))]
            # The tag's step (100 IDs), so that each worker fetches several segments during the test.
            configs = [
                msgspec.structs.replace(c, rate=msgspec.structs.replace(c.rate, adaptive_step=False))
                for c in configs
            ]
            async with running_worker(configs[0]), running_worker(configs[1]):
                (a_ids, a_ranges), (b_ids, b_ranges), (plain, _) = await asyncio.gather(
                    _draw(url_a, "order"), _draw(url_b, "order"), _draw(url_a, "plain")
                )
        conn = await asyncpg.connect(dsn_a)
        try:
            a_max_id = await conn.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = 'order'")
            columns = await conn.fetch(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'leaf_alloc'"
            )
        finally:
            await conn.close()
    finally:
        postgres_server.drop_database("residue_a")

    assert len(a_ids) == len(b_ids) == 30 * 37 + 10 * 50
    assert all(i % 2 == 0 for i in a_ids)
    assert all(i % 2 == 1 for i in b_ids)
    assert not set(a_ids) & set(b_ids)
    assert a_ids == sorted(set(a_ids))  # one worker per datacenter: its IDs increase strictly
    assert b_ids == sorted(set(b_ids))
    # A strided segment is not contiguous: the `ranges` format gives one-ID ranges, right for any reader.
    assert a_ranges
    assert all(first == last for first, last in a_ranges + b_ranges)
    # leaf_alloc.max_id is still a high water of IDs (every ID handed out lies below it), and the table is
    # Leaf's column for column.
    assert max(a_ids) < a_max_id
    assert {r["column_name"] for r in columns} == {"biz_tag", "max_id", "step", "description", "update_time"}
    # A Leaf tag beside it: every ID, in order, as before.
    assert plain == list(range(1, len(plain) + 1))
