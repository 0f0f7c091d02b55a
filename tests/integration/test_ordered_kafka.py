"""An ordered tag over Kafka (real broker, NATS and PostgreSQL): the Kafka worker asks the owner over NATS."""

from __future__ import annotations

import pytest

from dispenser.adapters.postgres.ordered import set_ordered
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app.ordered import Ordered
from dispenser.client import KafkaIdClient
from dispenser.config import load_config
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import kafka_config, unique
from .segment_support import ask, client, ids_of, prepare, running_worker, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.nats, pytest.mark.postgres]


async def test_kafka_requests_for_an_ordered_tag_are_answered_by_its_owner(
    kafka_broker: KafkaBroker, nats_server: NatsServer, pg_dsn: str
) -> None:
    """Kafka and NATS in turn, the owner a NATS-only worker: each answer above every one before it."""
    await prepare(pg_dsn, [("ord", 50)])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await set_ordered(store, "ord", 3.0)
    nats_only = load_config(environ={"DISPENSER_NATS_URL": nats_server.url, "DISPENSER_POSTGRES_DSN": pg_dsn})
    with_kafka = kafka_config(
        kafka_broker.bootstrap,
        pg_dsn,
        nats_enabled=True,
        nats_url=nats_server.url,
        kafka_enabled=True,
        kafka_request_topic=unique("requests"),
        kafka_reply_topic=unique("replies"),
        kafka_group_id=unique("group"),
    )
    async with running_worker(nats_only) as owner, client(nats_server.url) as nc:
        assert isinstance(owner.ordered, Ordered)
        await wait_until(owner.ordered.tags["ord"].serving, what="the first worker owns the tag")
        async with (
            running_worker(with_kafka) as kafka_worker,
            KafkaIdClient(kafka_worker.config.kafka, timeout=20.0) as kc,
        ):
            received: list[list[int]] = []
            for _ in range(3):
                received.append(await kc.ids("ord", 3))
                received.append(ids_of(await ask(nc, "leaf.segment.ord", b'{"count": 2}')))
        assert owner.ordered.routes["ord"].answered == 6
    highest = -1
    for ids in received:
        assert ids == sorted(ids)
        assert ids[0] > highest, received
        highest = ids[-1]
