"""Kafka-only workers (NATS off) hear their peers' rate events on the Kafka rate topic, as NATS workers do."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from dispenser.app import Off, Worker
from dispenser.client import KafkaIdClient
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import kafka_config, unique

pytestmark = [pytest.mark.kafka]


@contextlib.asynccontextmanager
async def kafka_only_worker(
    bootstrap: str, rate_topic: str, worker_id: int, state: Path
) -> AsyncIterator[Worker]:
    """A snowflake worker with NATS off, its own request topic, and the shared rate topic."""
    config = kafka_config(
        bootstrap,
        None,
        kafka_enabled=True,
        kafka_request_topic=unique("requests"),
        kafka_reply_topic=unique("replies"),
        kafka_group_id=unique("group"),
        rate_kafka_topic=rate_topic,
        rate_interval=0.3,
        snowflake_enabled=True,
        snowflake_worker_id=worker_id,
        snowflake_state_dir=state,
    )
    async with Worker(config) as worker:
        yield worker


async def test_kafka_only_workers_hear_each_others_rate_events(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """Two workers without NATS, each handing out IDs of tag ``t``: each sees the other as a live peer.

    A malformed event on the topic is dropped without stopping the listener.
    """
    bootstrap = kafka_broker.bootstrap
    rate_topic = unique("rate")
    async with (
        kafka_only_worker(bootstrap, rate_topic, 1, tmp_path / "a") as first,
        kafka_only_worker(bootstrap, rate_topic, 2, tmp_path / "b") as second,
    ):
        assert first.parts.nats == second.parts.nats == Off("nats.enabled")
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(rate_topic, b"not an event", key=b"t")
        finally:
            await producer.stop()
        for worker in (first, second):
            async with KafkaIdClient(worker.config.kafka, timeout=20.0) as client:
                assert len(await client.ids("t", 10, kind="snowflake")) == 10
        deadline = time.monotonic() + 30
        while True:
            heard = {
                (w.rates.worker, event.worker)
                for w in (first, second)
                for event in w.rates.peers("snowflake", "t")
            }
            if heard == {
                (first.rates.worker, second.rates.worker),
                (second.rates.worker, first.rates.worker),
            }:
                break
            assert time.monotonic() < deadline, f"peers heard after 30 s: {heard}"
            await asyncio.sleep(0.05)
        for worker in (first, second):
            assert worker.rate_listener.received >= 1
        for worker in (first, second):  # each sizes from a fleet of two
            assert worker.rates.view("snowflake", "t").workers == 2
