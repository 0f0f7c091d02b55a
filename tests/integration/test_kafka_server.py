"""The Kafka test server itself: jars from Maven Central, a KRaft broker that starts, restarts and keeps its data."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dispenser.devservers._process import port_is_free
from dispenser.devservers.kafka import KafkaBroker, default_jar_dir, fetch_kafka_jars, metadata_brokers

from .kafka_support import TopicReader, create_topics, produce, unique

pytestmark = pytest.mark.kafka


def test_jar_fetch_is_done_once() -> None:
    """A second fetch finds the stamp and returns at once, without Maven."""
    jars = fetch_kafka_jars()
    assert jars == default_jar_dir()
    assert any(jars.glob("kafka_2.13-*.jar"))
    started = time.monotonic()
    assert fetch_kafka_jars() == jars
    assert time.monotonic() - started < 0.5


async def test_the_shared_broker_serves_produce_and_consume(kafka_broker: KafkaBroker) -> None:
    """The session broker lists itself in its metadata and keeps records with keys and headers."""
    assert metadata_brokers(kafka_broker.port) == 1
    topic = unique("server-check")
    await create_topics(kafka_broker.bootstrap, {topic: 2})
    await produce(kafka_broker.bootstrap, topic, [(1, b"k", b"v", [("h", b"1")])])
    async with TopicReader(kafka_broker.bootstrap, topic) as reader:
        (record,) = await reader.wait_for(1, timeout=30)
    assert (record.partition, record.key, record.value, record.headers) == (1, b"k", b"v", [("h", b"1")])


async def test_restart_keeps_ports_and_data_and_kill_is_survived(tmp_path: Path) -> None:
    """Stop/start and kill/start keep the ports, the topics and the records; stop frees the port."""
    broker = KafkaBroker(tmp_path / "kafka")
    broker.start()
    try:
        port, controller = broker.port, broker.controller_port
        topic = unique("kept")
        await create_topics(broker.bootstrap, {topic: 1})
        await produce(broker.bootstrap, topic, [(0, None, b"before", [])])
        broker.stop()
        assert port_is_free(port)
        broker.start()
        assert (broker.port, broker.controller_port) == (port, controller)
        broker.kill()
        broker.start()
        async with TopicReader(broker.bootstrap, topic) as reader:
            (record,) = await reader.wait_for(1, timeout=30)
        assert record.value == b"before"
    finally:
        broker.stop()
    assert broker.pid is None
