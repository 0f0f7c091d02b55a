"""Hostile request_ids cannot take idempotency from other callers (issue 33, items 1 and 2).

A NUL in one request_id made PostgreSQL refuse the replay store's whole batch, so up to 512 other callers'
answers went unrecorded (or, with ``dedup_unsettled = "refuse"``, were refused); invalid UTF-8 in a URL's
query decoded to U+FFFD, so ``?request_id=%ff``, ``%fe`` and ``%c0`` shared one key and one ID. Both are
refused at decode now, and the replay store records the rest of a batch when PostgreSQL refuses one row.
Real NATS, real PostgreSQL, and an HTTP client sending the bytes as written.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import msgspec
import pytest
from yarl import URL

from dispenser.adapters.postgres.replay import PostgresReplayStore
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.config import load_config
from dispenser.core.errors import BadRequest, StoreRefusedValue
from dispenser.ports import Settled
from dispenser_lab.servers import NatsServer

from .segment_support import ask, client, ids_of, prepare, running_worker, worker_config

pytestmark = [pytest.mark.postgres]

ERROR_CODE_HEADER = "Dispenser-Error-Code"


@pytest.fixture
async def replay_store(pg_dsn: str) -> AsyncIterator[PostgresReplayStore]:
    """The PostgreSQL replay store on a migrated database of this test's own."""
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        yield PostgresReplayStore(store)


async def recorded(dsn: str) -> set[str]:
    """The request_ids the replay table holds."""
    conn = await asyncpg.connect(dsn)
    try:
        return {row["request_id"] for row in await conn.fetch("SELECT request_id FROM dispenser_request")}
    finally:
        await conn.close()


@pytest.mark.parametrize("bad", ["a\x00b", "x" * 129], ids=["nul", "too-long"])
async def test_a_row_postgresql_refuses_fails_alone_and_the_rest_of_its_batch_is_recorded(
    replay_store: PostgresReplayStore, pg_dsn: str, bad: str
) -> None:
    """20 answers settled at once, one with a key PostgreSQL refuses (a data error, SQLSTATE class 22).

    The 19 others are recorded and returned; the bad one fails with a coded, non-retryable error that is
    not ``unavailable`` (the store is up: no retry of that request can succeed).
    """
    keys = [f"good-{n}" for n in range(19)]
    keys.insert(7, bad)
    results = await asyncio.gather(
        *(
            replay_store.settle(("segment", "order", key), 1, "ids", ((n, n),), 60)
            for n, key in enumerate(keys, start=1)
        ),
        return_exceptions=True,
    )
    refused = results.pop(7)
    assert isinstance(refused, StoreRefusedValue), refused
    assert isinstance(refused, BadRequest)
    assert (refused.code, refused.retryable) == ("invalid", False)
    assert "22" in refused.message  # the SQLSTATE, class 22
    good = [key for key in keys if key != bad]
    assert results == [Settled(1, "ids", ((n, n),)) for n in range(1, 21) if n != 8]
    assert await recorded(pg_dsn) == set(good)


@pytest.mark.nats
async def test_a_nul_in_one_request_id_over_nats_is_refused_and_costs_the_others_nothing(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """A NUL in one of 41 concurrent request_ids over NATS: that one is refused, the 40 others recorded.

    ``"a\u0000b"`` gets ``invalid`` (not retryable); the 40 get IDs, and every one of their answers is
    recorded in PostgreSQL (none answered unrecorded).
    """
    await prepare(pg_dsn, [("order", 1000)])
    good = [f"r-{n}" for n in range(40)]
    bodies = [msgspec.json.encode({"request_id": key}) for key in good]
    bodies.insert(20, b'{"request_id": "a\\u0000b"}')
    async with (
        running_worker(worker_config(nats_server.url, pg_dsn)) as worker,
        client(nats_server.url) as nc,
    ):
        replies = await asyncio.gather(*(ask(nc, "leaf.segment.order", body) for body in bodies))
        poisoned = replies.pop(20)
        assert poisoned.error is not None, poisoned
        assert (poisoned.error.code, poisoned.error.retryable) == ("invalid", False)
        assert "request_id" in poisoned.error.message
        answered = [ids_of(reply) for reply in replies]
        assert len({i for ids in answered for i in ids}) == len(good)
        assert worker.dispatchers["segment"].replays_unsettled == 0
    assert await recorded(pg_dsn) == set(good)


@pytest.mark.nats
async def test_invalid_utf8_and_nul_in_an_http_query_are_refused_not_merged_into_one_key(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Invalid UTF-8, NUL and space in ``?request_id=`` over HTTP: each refused, none merged into one key.

    ``%ff``, ``%fe``, ``%c0`` (all U+FFFD once decoded), ``%00``, ``a%20b``: each refused with ``invalid``
    in Leaf's form and in the batch form, no ID handed out; a good one still gets its ID, twice.
    """
    await prepare(pg_dsn, [("order", 1000)])
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": pg_dsn,
        "DISPENSER_HTTP_PORT": "0",
    }
    async with running_worker(load_config(environ=env)) as worker, aiohttp.ClientSession() as session:
        base = f"{worker.http.url}/api/segment/get/order"
        for escaped in ("%ff", "%fe", "%c0", "%00", "a%20b", "a%00b"):
            for query in (f"request_id={escaped}", f"count=1&request_id={escaped}"):
                # encoded=True: the client sends the bytes as written, as an attacker's would.
                async with session.get(URL(f"{base}?{query}", encoded=True)) as response:
                    body = await response.text()
                    assert response.headers.get(ERROR_CODE_HEADER) == "invalid", (
                        query,
                        response.status,
                        body,
                    )
                    assert response.status != 200, (query, body)
                    assert "request_id" in body, (query, body)
        async with session.get(URL(f"{base}?request_id=r-1", encoded=True)) as response:
            assert response.status == 200
            first = int(await response.text())
        async with session.get(URL(f"{base}?request_id=r-1", encoded=True)) as response:
            assert int(await response.text()) == first  # the same key, the same ID
    assert await recorded(pg_dsn) == {"r-1"}
