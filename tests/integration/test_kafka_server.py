"""The Kafka test server itself: jars from Maven Central, a KRaft broker that starts, restarts and keeps its data."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from dispenser.adapters.kafka.connection import ensure_topics
from dispenser.config import KafkaConfig
from dispenser_lab.servers.kafka import KafkaBroker, default_jar_dir, fetch_kafka_jars, metadata_brokers
from dispenser_lab.servers.kafka_markers import DroppedMarkers, write_markers
from dispenser_lab.servers.kafka_wire import metadata
from dispenser_lab.servers.process import port_is_free

from .kafka_support import TopicReader, create_topics, produce, unique
from .zk_support import eventually

pytestmark = pytest.mark.kafka

# A fresh JVM is slow for its first seconds (KAFKA.md §6); real times are well under a second.
_TIMEOUT = 60.0


def test_jar_fetch_is_done_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second fetch finds the stamp and returns at once, without looking for Maven."""
    jars = fetch_kafka_jars()
    assert jars == default_jar_dir()
    assert any(jars.glob("kafka_2.13-*.jar"))
    monkeypatch.setenv("PATH", "")  # no mvn to be found
    started = time.monotonic()
    assert fetch_kafka_jars() == jars
    assert time.monotonic() - started < 0.5


async def test_the_shared_broker_serves_admin_produce_and_consume(kafka_broker: KafkaBroker) -> None:
    """The session broker lists itself, creates topics, keeps keys and headers, and allows short sessions."""
    assert metadata_brokers(kafka_broker.port) == 1
    topic = unique("server-check")
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    async with asyncio.timeout(_TIMEOUT):
        await admin.start()
        try:
            response = await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
            assert [(name, code) for name, code, *_ in response.topic_errors] == [(topic, 0)]
            # The controller acknowledged it; the broker answering list_topics learns it from the metadata log a
            # moment later (KRaft): it must appear (seen missing on the first ask once, in a fresh-clone run).

            async def listed() -> None:
                assert topic in await admin.list_topics()

            await eventually(listed, timeout=10.0, interval=0.05, what=f"{topic} listed")
        finally:
            await admin.close()
        await produce(kafka_broker.bootstrap, topic, [(1, b"k", b"v", [("h", b"1")])])
        # A 1 s session is below Kafka's default minimum (6 s): the broker's group.min.session.timeout.ms allows it.
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_broker.bootstrap,
            group_id=unique("server-check"),
            auto_offset_reset="earliest",
            session_timeout_ms=1000,
            heartbeat_interval_ms=300,
        )
        await consumer.start()
        try:
            record = await consumer.getone()
        finally:
            await consumer.stop()
    assert (record.partition, record.key, record.value, list(record.headers)) == (
        1,
        b"k",
        b"v",
        [("h", b"1")],
    )


async def test_read_committed_sees_committed_transactions_only(kafka_broker: KafkaBroker) -> None:
    """Records of a committed transaction are visible under read_committed; those of an aborted one are not."""
    bootstrap = kafka_broker.bootstrap
    topic = unique("txn")
    await create_topics(bootstrap, {topic: 1})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=unique("txn-id"))
    async with asyncio.timeout(_TIMEOUT):
        await producer.start()
        try:
            async with producer.transaction():
                await producer.send_and_wait(topic, b"committed", partition=0)
            await producer.begin_transaction()
            await producer.send_and_wait(topic, b"aborted", partition=0)
            await producer.abort_transaction()
            # Committed after the aborted one, so a reader that got this far has passed the aborted record.
            async with producer.transaction():
                await producer.send_and_wait(topic, b"after", partition=0)
        finally:
            await producer.stop()
    async with TopicReader(bootstrap, topic) as committed:
        records = await committed.wait_for(2, timeout=_TIMEOUT)
    assert [r.value for r in records] == [b"committed", b"after"]
    async with TopicReader(bootstrap, topic, committed=False) as uncommitted:
        records = await uncommitted.wait_for(3, timeout=_TIMEOUT)
    assert [r.value for r in records] == [b"committed", b"aborted", b"after"]


async def test_a_caught_up_reader_holds_every_committed_record(kafka_broker: KafkaBroker) -> None:
    """``TopicReader.wait_caught_up`` waits on positions, not time: asked at once, nothing is missing.

    An open transaction after the records holds the last stable offset back: the reader is caught up below
    it and must not wait for it (nor see its record).
    """
    bootstrap = kafka_broker.bootstrap
    topic = unique("caught-up")
    await create_topics(bootstrap, {topic: 3})
    await produce(bootstrap, topic, [(i % 3, None, str(i).encode(), []) for i in range(300)])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=unique("open-txn"))
    async with asyncio.timeout(_TIMEOUT):
        await producer.start()
        try:
            await producer.begin_transaction()
            await producer.send_and_wait(topic, b"open", partition=1)
            async with TopicReader(bootstrap, topic) as reader:
                await reader.wait_caught_up(_TIMEOUT)  # no count given: the positions alone say "done"
                values = sorted(int(r.value or b"") for r in reader.records)
            await producer.abort_transaction()
        finally:
            await producer.stop()
    assert values == list(range(300))


async def test_restart_keeps_ports_and_data_and_kill_is_survived(private_kafka: KafkaBroker) -> None:
    """Stop/start and kill/start keep the ports, the topics and the records; stop frees the port."""
    broker = private_kafka
    port, controller = broker.port, broker.controller_port
    topic = unique("kept")
    await create_topics(broker.bootstrap, {topic: 1})
    await produce(broker.bootstrap, topic, [(0, None, b"before", [])])
    broker.stop()
    assert broker.pid is None
    assert port_is_free(port)
    broker.start()
    assert (broker.port, broker.controller_port) == (port, controller)
    broker.kill()
    assert broker.pid is None
    broker.start()
    assert (broker.port, broker.controller_port) == (port, controller)
    assert metadata_brokers(port) == 1
    async with TopicReader(broker.bootstrap, topic) as reader:
        (record,) = await reader.wait_for(1, timeout=_TIMEOUT)
    assert record.value == b"before"
    assert (broker.data_dir / "meta.properties").is_file()  # formatted once, kept


async def test_created_topics_default_to_one_replica_on_a_single_broker(kafka_broker: KafkaBroker) -> None:
    """``kafka.replication_factor`` unset: min(3, brokers), so a dev broker's topics get 1 (3 would be refused)."""
    topic = unique("replicas")
    assert await ensure_topics(KafkaConfig(bootstrap_servers=kafka_broker.bootstrap), {topic: 2}) == [topic]
    answer = metadata(kafka_broker.port, [topic])
    assert answer is not None
    assert sorted(answer.partitions) == [(topic, 0), (topic, 1)]
    assert all(state.replicas == (1,) for state in answer.partitions.values())


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
async def test_markers_written_by_hand_end_an_open_transaction(
    kafka_broker: KafkaBroker, commit: bool
) -> None:
    """The test kit's repair of dropped markers, on the wire: a commit shows the records, an abort hides them.

    A transaction left open (its producer never ends it) is ended by WriteTxnMarkers as its coordinator would;
    read_committed readers then move past it (the last stable offset reaches the end).
    """
    topic = unique("markers")
    await create_topics(kafka_broker.bootstrap, {topic: 1})
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap, transactional_id=unique("markers"))
    await producer.start()
    try:
        await producer.begin_transaction()
        for n in range(5):
            await (await producer.send(topic, str(n).encode(), partition=0))
        # aiokafka's own record of what the coordinator gave it (no public accessor; a test may look).
        txn = producer._txn_manager
        dropped = DroppedMarkers(
            transactional_id="by-hand",
            producer_id=txn.producer_id,
            producer_epoch=txn.producer_epoch,
            coordinator_epoch=0,
            commit=commit,
            partitions=((topic, 0),),
        )
        assert await asyncio.to_thread(write_markers, kafka_broker.port, dropped)
        async with TopicReader(kafka_broker.bootstrap, topic) as reader:
            await reader.wait_caught_up(30)
            assert [r.value for r in reader.records] == (
                [str(n).encode() for n in range(5)] if commit else []
            )
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), 10)
