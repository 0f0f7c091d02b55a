"""Two databases serving one tag in classes that share IDs: the second worker refuses (docs/datacenters.md).

Two PostgreSQL servers (A's, B's), a NATS server per datacenter joined by gateways (so that each
datacenter's caller reaches its own worker), a worker in each on its own database. Before the guard,
``--stride 2`` with offset 0 in both handed out 300 of 600 IDs twice, and ``dispenser check`` was silent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import asyncpg
import msgspec
import pytest
from nats.aio.subscription import Subscription

from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.config import Config
from dispenser.core.residue import LEAF, Residue
from dispenser.health import check_all
from dispenser.messages import Reply, ResidueClaims, TagResidue
from dispenser_lab.servers import NatsGateways, NatsServer, PostgresServer
from tests.integration.segment_support import client, request, running_worker, worker_config

pytestmark = [pytest.mark.postgres, pytest.mark.nats]

ResidueClaims_ = msgspec.json.Decoder(ResidueClaims)

STEP = 50
# tag: (A's class, B's class). The first three share IDs; "apart" does not.
CLASSES = {
    "same": (Residue(2, 0), Residue(2, 0)),  # `--stride 2` in both, offset 0 by default before
    "strides": (Residue(3, 1), Residue(2, 0)),  # 1 mod 3 and 0 mod 2 share 4, 10, ...
    "plain": (LEAF, Residue(2, 1)),  # a Leaf tag beside a strided one: every ID is the former's
    "apart": (Residue(2, 0), Residue(2, 1)),
}


async def _prepare(dsn: str, side: int) -> str:
    """Migrate, add the tags with this side's classes; returns the server's system identifier."""
    await migrate(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        for tag, classes in CLASSES.items():
            await store.add_tag(tag, STEP, residue=classes[side])
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval("SELECT system_identifier FROM pg_control_system()"))
    finally:
        await conn.close()


async def _ask(url: str, tag: str, count: int = 20) -> Reply:
    """One request for ``count`` IDs of ``tag`` from a caller at ``url``."""
    async with client(url) as nc:
        body = msgspec.json.encode({"count": count})
        return msgspec.json.decode((await request(nc, f"leaf.segment.{tag}", body)).data, type=Reply)


def _config(url: str, dsn: str, datacenter: str, state_dir: Path) -> Config:
    """A worker in ``datacenter`` on ``dsn``, its grants in a state directory of its own."""
    config = worker_config(url, dsn, state_dir=str(state_dir))
    return msgspec.structs.replace(config, nats=msgspec.structs.replace(config.nats, datacenter=datacenter))


async def test_the_second_database_refuses_a_tag_whose_class_intersects(
    postgres_server: PostgresServer,
    private_postgres: PostgresServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A serves first; B refuses every intersecting tag with residue_overlap (no ID), serves the disjoint one; check fails."""
    dsn_a = postgres_server.create_database("residue_overlap_a")
    dsn_b = private_postgres.dsn
    try:
        system_a = await _prepare(dsn_a, 0)
        system_b = await _prepare(dsn_b, 1)
        assert system_a != system_b
        with NatsGateways(tmp_path / "nats", ("dc-a", "dc-b")) as dcs:
            url_a, url_b = dcs.url_of("dc-a"), dcs.url_of("dc-b")
            config_a = _config(url_a, dsn_a, "dc-a", tmp_path / "a")
            config_b = _config(url_b, dsn_b, "dc-b", tmp_path / "b")
            async with running_worker(config_a):
                served_a = {tag: await _ask(url_a, tag) for tag in CLASSES}
                async with running_worker(config_b):
                    with caplog.at_level(logging.WARNING):
                        served_b = {tag: await _ask(url_b, tag) for tag in CLASSES}
                        again = await _ask(url_b, "same")
                    results = {r.name: r for r in await check_all(config_b)}
    finally:
        postgres_server.drop_database("residue_overlap_a")

    ids_a = {tag: reply.ids for tag, reply in served_a.items()}
    assert all(ids and len(ids) == 20 for ids in ids_a.values()), served_a
    for tag in ("same", "strides", "plain"):
        reply = served_b[tag]
        assert reply.ids is None
        assert reply.error is not None
        assert (reply.error.code, reply.error.retryable) == ("residue_overlap", False)
        # Both databases named, by system identifier.
        assert system_a in reply.error.message
        assert system_b in reply.error.message
    assert again.error is not None
    assert again.error.code == "residue_overlap"  # refused for good, not once
    # The disjoint class is served: odd IDs beside A's even ones, none repeated.
    apart_b = served_b["apart"].ids
    assert apart_b
    assert all(i % 2 == 1 for i in apart_b)
    assert not set(apart_b) & set(ids_a["apart"] or [])
    # One ERROR line per refused tag in B; A warns that a worker of another database was turned away.
    assert sum("is not served by this worker" in r.getMessage() for r in caplog.records) == 3
    assert "was refused tag 'same'" in caplog.text
    check = results["residue classes"]
    assert not check.ok
    assert "'same'" in check.detail
    assert system_b in check.detail


async def test_disjoint_classes_both_serve_and_check_passes(
    postgres_server: PostgresServer, private_postgres: PostgresServer, tmp_path: Path
) -> None:
    """2:0 in A and 2:1 in B, A's and B's callers at once: both serve, no ID repeats, and check passes."""
    dsn_a = postgres_server.create_database("residue_apart_a")
    dsn_b = private_postgres.dsn
    try:
        for dsn, offset in ((dsn_a, 0), (dsn_b, 1)):
            await migrate(dsn)
            async with await PostgresSegmentStore.connect(dsn) as store:
                await store.add_tag("order", STEP, residue=Residue(2, offset))
        with NatsGateways(tmp_path / "nats", ("dc-a", "dc-b")) as dcs:
            url_a, url_b = dcs.url_of("dc-a"), dcs.url_of("dc-b")
            config_a = _config(url_a, dsn_a, "dc-a", tmp_path / "a")
            config_b = _config(url_b, dsn_b, "dc-b", tmp_path / "b")
            async with running_worker(config_a), running_worker(config_b):
                replies = [await _ask(url, "order", 100) for _ in range(3) for url in (url_a, url_b)]
                results = {r.name: r for r in await check_all(config_a)}
    finally:
        postgres_server.drop_database("residue_apart_a")
    ids = [i for reply in replies for i in reply.ids or []]
    assert all(reply.error is None for reply in replies), replies
    assert len(ids) == 600
    assert len(set(ids)) == 600
    check = results["residue classes"]
    assert check.ok, check.detail
    assert "from 2 database(s)" in check.detail


async def _next_of(subscription: Subscription, worker: str) -> ResidueClaims:
    """The next announcement by ``worker`` ("": by a worker, not this test)."""
    while True:
        message = ResidueClaims_.decode((await subscription.next_msg(timeout=2)).data)
        if message.worker == worker or (not worker and message.worker != "b1:1:beef"):
            return message


async def test_a_serving_worker_that_hears_a_serving_rival_stops_the_tag(
    pg_dsn: str, private_nats: NatsServer, tmp_path: Path
) -> None:
    """A worker that hears another database's serving claim on its tag's class refuses the tag, buffered IDs too.

    Two workers that served one class unheard by each other: the refusal is announced as having issued, so that
    the other refuses as well.
    """
    await migrate(pg_dsn)
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("order", 1000, residue=Residue(2, 0))
        await store.add_tag("other", 1000)
    config = _config(private_nats.url, pg_dsn, "dc-a", tmp_path / "a")
    async with running_worker(config) as worker, client(private_nats.url) as nc:
        announced = await nc.subscribe("leaf.segment-residue")
        first = await _ask(private_nats.url, "order")
        assert first.ids
        own = await _next_of(announced, "")
        assert [(c.tag, c.stride, c.offset, c.state) for c in own.claims] == [("order", 2, 0, "serving")]
        # Another database's worker, serving the same class of the tag (it did not hear this one in time).
        rival = ResidueClaims(
            worker="b1:1:beef",
            datacenter="dc-b",
            system_identifier="1234",
            database="other",
            claims=[TagResidue(tag="order", stride=2, offset=0)],
        )
        await nc.publish("leaf.segment-residue", msgspec.json.encode(rival))
        refusal = await _next_of(announced, own.worker)
        assert [(c.tag, c.state, c.issued) for c in refusal.claims] == [("order", "refused", True)]
        assert refusal.worker == own.worker
        after = await _ask(private_nats.url, "order", 1)  # 980 IDs were still buffered: none handed out
        assert after.error is not None
        assert after.error.code == "residue_overlap"
        assert "PostgreSQL system 1234" in after.error.message
        assert (await _ask(private_nats.url, "other", 1)).ids == [1]  # other tags go on
        assert worker.residue_guard.refusal("order") is not None
