"""The sqids format end to end: a real worker over NATS, Leaf's HTTP API and Kafka, real PostgreSQL.

Each string decodes (``from_sqid``, ``dispenser decode``) to the integer its counter gives: a fresh tag on
one worker draws its counters in order, so the n-th string must be the permutation of counter n.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import msgspec
import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app import Worker
from dispenser.client import KafkaIdClient
from dispenser.core.sqids_form import from_sqid
from dispenser.messages import Reply
from dispenser.service.permuted import load_permutation
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import kafka_config, serving_topics
from .segment_support import ask, client, ids_of, prepare, running_worker
from .test_permuted import KEY1, cli, config, permuted_and_plain


def strings(reply: Reply) -> list[str]:
    assert reply.error is None, reply.error
    assert reply.sqids is not None
    assert all(len(s) == 12 for s in reply.sqids)
    return reply.sqids


@pytest.mark.nats
@pytest.mark.postgres
async def test_sqids_over_nats_and_http_decode_to_the_counters_ids(
    nats_server: NatsServer,
    pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Strings over NATS, HTTP and `dispenser get --sqids`, integers between: counters 1.. in order; plain too."""
    monkeypatch.setenv("DISPENSER_NATS_URL", nats_server.url)
    await permuted_and_plain(monkeypatch, pg_dsn, tmp_path)
    (tmp_path / "order.keys").write_text(f"1 {KEY1}\n")
    got: list[int] = []
    async with (
        running_worker(config(nats_server.url, pg_dsn, tmp_path)) as worker,
        client(nats_server.url) as nc,
    ):
        over_nats = strings(await ask(nc, "leaf.segment.order", b'{"count": 4, "format": "sqids"}'))
        got += [from_sqid(s) for s in over_nats]
        got += ids_of(await ask(nc, "leaf.segment.order", b'{"count": 2}'))
        assert worker.http is not None
        async with (
            aiohttp.ClientSession(worker.http.url) as session,
            session.get("/api/segment/get/order", params={"format": "sqids", "count": "3"}) as response,
        ):
            assert response.status == 200
            over_http = strings(msgspec.json.decode(await response.read(), type=Reply))
        got += [from_sqid(s) for s in over_http]
        capsys.readouterr()
        assert await cli("get", "order", "2", "--sqids") == 0  # one string a line
        got += [from_sqid(s) for s in capsys.readouterr().out.split()]
        plain = strings(await ask(nc, "leaf.segment.plain", b'{"count": 3, "format": "sqids"}'))
    permutation = load_permutation(tmp_path, "order")
    assert got == [permutation.encode(n) for n in range(1, 12)]
    assert [from_sqid(s) for s in plain] == [1, 2, 3]  # a plain tag's strings hide nothing
    capsys.readouterr()
    assert await cli("decode", "--tag", "order", over_http[-1]) == 0
    assert "counter:   9\n" in capsys.readouterr().out


@pytest.mark.kafka
@pytest.mark.postgres
async def test_sqids_over_kafka_decode_to_the_counters_ids(
    kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path
) -> None:
    """Strings over Kafka, then integers, then a request_id's retry: the same counters' IDs, in order."""
    await prepare(pg_dsn, [])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("order", 100, permuted=True)
    (tmp_path / "order.keys").write_text(f"1 {KEY1}\n")
    settings = kafka_config(
        kafka_broker.bootstrap, pg_dsn, **serving_topics(), segment_permute_keys_dir=tmp_path
    )
    async with Worker(settings) as worker, KafkaIdClient(worker.config.kafka, timeout=20.0) as kafka:
        first = strings(await kafka.request("order", 3, format="sqids"))
        ids = await kafka.ids("order", 2)
        again = strings(await kafka.request("order", 2, format="sqids", request_id="r-1"))
        assert strings(await kafka.request("order", 2, format="sqids", request_id="r-1")) == again
    got = [from_sqid(s) for s in first] + ids + [from_sqid(s) for s in again]
    permutation = load_permutation(tmp_path, "order")
    assert got == [permutation.encode(n) for n in range(1, 8)]
