"""A daily tag over Kafka (real broker and PostgreSQL): the same IDs of the day, request_id retries too."""

from __future__ import annotations

from datetime import datetime

import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app import Worker
from dispenser.client import KafkaIdClient
from dispenser.core.daily import DailyPolicy
from dispenser.ports import SystemClock
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import kafka_config, serving_topics
from .segment_support import prepare
from .snowflake_support import ShiftableClock

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

NOON_MS = int(datetime.fromisoformat("2026-11-28T12:00:00+00:00").timestamp() * 1000)


async def test_a_daily_tag_over_kafka(kafka_broker: KafkaBroker, pg_dsn: str) -> None:
    """A day's IDs and ranges from 1 (2026-11-28), and a retry with the same request_id gets the same IDs."""
    await prepare(pg_dsn, [])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await store.add_tag("invoice", 100, daily=DailyPolicy.checked(6, "UTC"))
    config = kafka_config(
        kafka_broker.bootstrap,
        pg_dsn,
        **serving_topics(),
    )
    clock = ShiftableClock(NOON_MS - SystemClock().wall_ms())
    async with Worker(config, clock) as worker, KafkaIdClient(worker.config.kafka, timeout=20.0) as client:
        assert await client.ids("invoice", 3) == [20261128000001, 20261128000002, 20261128000003]
        assert await client.ranges("invoice", 5) == [(20261128000004, 20261128000008)]
        first = await client.ids("invoice", 2, request_id="r-1")
        assert await client.ids("invoice", 2, request_id="r-1") == first
        assert first == [20261128000009, 20261128000010]
