"""One client's bad reply address stalls nobody else: replies to a missing topic or partition are dropped fast.

Before, a reply to a topic that does not exist waited for the topic's metadata inside the consume loop, up
to ``request_timeout_ms`` (then 30 s by default), and every request behind it on the worker waited with it.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from dispenser.adapters.kafka.connection import CORRELATION_ID, REPLY_PARTITION, REPLY_TOPIC, encode_partition
from dispenser.app import Worker
from dispenser.client import KafkaIdClient
from dispenser_lab.servers.kafka import KafkaBroker

from .kafka_support import kafka_config, unique

pytestmark = [pytest.mark.kafka]

CLIENTS = 4
BAD_REQUESTS = 6
GENEROUS = 5.0
"""Seconds no good request may take: far under the 30 s a stall lasted (the client's timeout is 20 s)."""


@pytest.fixture
async def worker(kafka_broker: KafkaBroker, tmp_path: Path) -> AsyncIterator[Worker]:
    """A Kafka-only snowflake worker; its request topic has one partition, which every client shares."""
    config = kafka_config(
        kafka_broker.bootstrap,
        None,
        kafka_enabled=True,
        kafka_request_topic=unique("requests"),
        kafka_reply_topic=unique("replies"),
        kafka_group_id=unique("group"),
        rate_kafka_topic=unique("rate"),
        snowflake_enabled=True,
        snowflake_state_dir=tmp_path,
    )
    async with Worker(config) as running:
        yield running


async def _load(client: KafkaIdClient, latencies: list[float], stop: asyncio.Event) -> None:
    """One requester: a request at a time, as fast as replies come, until ``stop``."""
    while not stop.is_set():
        started = time.monotonic()
        assert len(await client.ids("t", 1, kind="snowflake")) == 1
        latencies.append(time.monotonic() - started)


@pytest.mark.parametrize("bad", ["missing_topic", "partition_out_of_range"])
async def test_undeliverable_replies_do_not_hold_up_the_other_clients(
    worker: Worker, caplog: pytest.LogCaptureFixture, bad: str
) -> None:
    """Six requests with a bad reply address among four clients' requests on one partition: nobody waits.

    Every good reply still comes back fast; the bad ones are counted, and logged once.
    """
    kafka = worker.config.kafka
    if bad == "missing_topic":
        target = unique("no-such-replies")
        headers = [(REPLY_TOPIC, target.encode())]
    else:
        assert kafka.reply_topic is not None
        target = kafka.reply_topic  # one partition: 7 is out of range
        headers = [(REPLY_TOPIC, target.encode()), (REPLY_PARTITION, encode_partition(7))]
    caplog.set_level(logging.WARNING, logger="dispenser.adapters.kafka.requests")
    clients = [KafkaIdClient(kafka, timeout=20.0) for _ in range(CLIENTS)]
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, linger_ms=0)
    await producer.start()
    for client in clients:
        await client.start()
    latencies: list[list[float]] = [[] for _ in clients]
    stop = asyncio.Event()
    try:
        for client in clients:  # warm: metadata known, partitions assigned
            await client.ids("t", 1, kind="snowflake")
        loads = [asyncio.create_task(_load(c, lat, stop)) for c, lat in zip(clients, latencies, strict=True)]
        for i in range(BAD_REQUESTS):
            await _above(lambda: sum(map(len, latencies)), sum(map(len, latencies)) + 20, "good replies")
            body = b'{"tag": "t", "kind": "snowflake", "count": 1}'
            await producer.send_and_wait(
                kafka.request_topic, body, key=b"t", headers=[*headers, (CORRELATION_ID, f"bad-{i}".encode())]
            )
        stats = worker.kafka.stats
        await _above(lambda: stats.undeliverable, BAD_REQUESTS - 1, "the bad replies to be given up")
        # And the good clients are still served after the last bad one was given up.
        await _above(lambda: sum(map(len, latencies)), sum(map(len, latencies)) + 50, "good replies after")
        stop.set()
        await asyncio.gather(*loads)
    finally:
        stop.set()
        for client in clients:
            await client.close()
        await producer.stop()
    assert stats.undeliverable == BAD_REQUESTS
    every = sorted(x for lat in latencies for x in lat)
    p50, p99 = statistics.median(every), every[int(len(every) * 0.99)]
    print(
        f"{bad}: {len(every)} good replies, p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {every[-1] * 1000:.1f} ms"
    )
    assert every[-1] < GENEROUS, f"a good request waited {every[-1]:.1f} s"
    warnings = [r for r in caplog.records if "cannot deliver a reply" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # logged once, the others counted
    assert target in warnings[0].getMessage()
    (metric,) = [m for m in worker.registry.collect() if m.name == "leaf_kafka_replies_undeliverable"]
    assert metric.samples[0].value == BAD_REQUESTS


async def _above(value: Callable[[], int], floor: int, what: str, timeout: float = 30.0) -> None:
    """Wait until ``value()`` is above ``floor``."""
    deadline = time.monotonic() + timeout
    while value() <= floor:
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.01)
