"""A permuted tag over Kafka (real broker and PostgreSQL): permuted IDs and ranges, a request_id's retry."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app import Worker
from dispenser.client import KafkaIdClient
from dispenser.core.permute import SPAN
from dispenser.service.permuted import load_permutation
from dispenser_lab.servers.kafka import KafkaBroker
from tests.secret_values import SECRETS

from .kafka_support import kafka_config, serving_topics
from .segment_support import prepare

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


async def test_a_permuted_tag_over_kafka(kafka_broker: KafkaBroker, pg_dsn: str, tmp_path: Path) -> None:
    """IDs and ranges of counters 1.. permuted (one range per ID), and a retry with a request_id the same."""
    await prepare(pg_dsn, [])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("order", 100)
    (tmp_path / "order.keys").write_text(f"1 {SECRETS['permute_key']}\n")
    config = kafka_config(
        kafka_broker.bootstrap,
        pg_dsn,
        **serving_topics(),
        segment_permute_keys_dir=tmp_path,
    )
    async with Worker(config) as worker, KafkaIdClient(worker.config.kafka, timeout=20.0) as client:
        ids = await client.ids("order", 3)
        ranges = await client.ranges("order", 4)
        first = await client.ids("order", 2, request_id="r-1")
        assert await client.ids("order", 2, request_id="r-1") == first
    assert all(first_id == last_id for first_id, last_id in ranges)
    got = ids + [first_id for first_id, _ in ranges] + first
    assert all(SPAN <= i < 2 * SPAN for i in got)
    permutation = load_permutation(tmp_path, "order")
    assert [permutation.decode(i) for i in got] == [(1, n) for n in range(1, 10)]
