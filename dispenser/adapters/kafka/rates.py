"""Rate events over the Kafka rate topic: how a Kafka-only worker (NATS off) tells and hears its fleet.

Every worker with Kafka on publishes its rate events to ``rate.kafka_topic`` (:class:`KafkaRateSink`).
:class:`KafkaRateListener` reads every partition of that topic, outside any consumer group (each worker must
see every event), from its end at start-up: an old event would make a peer that has long gone look alive,
since a peer counts as live for ``rate.stale_after`` seconds after its last event *was received*.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from dispenser.adapters.kafka.connection import client_options, ensure_topics, topic_partitions
from dispenser.config import KafkaConfig
from dispenser.messages import RateEvent

__all__ = ["KafkaRateListener", "KafkaRateSink"]

log = logging.getLogger(__name__)

_rate_events = msgspec.json.Decoder(RateEvent)


class KafkaRateListener:
    """Hands every rate event arriving on a Kafka topic to ``observe`` (malformed ones are logged and dropped).

    Args:
        config: How to reach Kafka.
        topic: The rate topic (``rate.kafka_topic``).
        observe: Called with each event, in the event loop (e.g. ``RateBook.observe``).
    """

    def __init__(self, config: KafkaConfig, topic: str, observe: Callable[[RateEvent], None]) -> None:
        self._config = config
        self.topic = topic
        self._observe = observe
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self.received = 0
        """Events handed to ``observe``."""

    async def start(self) -> None:
        """Create the topic if configured to, and start reading from its end.

        Raises:
            OSError: Kafka could not be reached, or the topic does not exist.
        """
        config = self._config
        if config.create_topics:
            await ensure_topics(config, {self.topic: config.topic_partitions})
        partitions = await topic_partitions(config, self.topic)
        consumer = AIOKafkaConsumer(**client_options(config), group_id=None, enable_auto_commit=False)
        try:
            await consumer.start()
            tps = [TopicPartition(self.topic, p) for p in range(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
        except KafkaError as exc:
            with contextlib.suppress(Exception):
                await consumer.stop()
            raise OSError(f"cannot reach Kafka at {config.bootstrap_servers}: {exc}") from exc
        self._consumer = consumer
        self._task = asyncio.create_task(self._read(consumer), name="kafka-rate-events")

    async def _read(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            try:
                fetched = await consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:  # the consumer reconnects by itself; don't spin while it does
                log.warning("Kafka rate events: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for records in fetched.values():
                for record in records:
                    try:
                        event = _rate_events.decode(record.value or b"")
                    except msgspec.DecodeError as exc:
                        log.warning("ignoring a malformed rate event on %s: %s", self.topic, exc)
                        continue
                    self.received += 1
                    self._observe(event)

    async def close(self) -> None:
        """Stop reading and disconnect."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            with contextlib.suppress(Exception):
                await consumer.stop()


class KafkaRateSink:
    """Publishes rate events to a Kafka topic, keyed by tag (one partition keeps a tag's events in order)."""

    def __init__(self, config: KafkaConfig, topic: str) -> None:
        self._config = config
        self.topic = topic
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        """Create the topic if configured to, and connect.

        Raises:
            OSError: Kafka could not be reached.
        """
        if self._config.create_topics:
            await ensure_topics(self._config, {self.topic: self._config.topic_partitions})
        self._producer = AIOKafkaProducer(**client_options(self._config), acks=1, linger_ms=20)
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self.close()
            raise OSError(f"cannot reach Kafka at {self._config.bootstrap_servers}: {exc}") from exc

    async def __call__(self, event: RateEvent) -> None:
        """Queue one event (delivery is not awaited: a lost rate event is replaced by the next one)."""
        if self._producer is not None:
            await self._producer.send(self.topic, msgspec.json.encode(event), key=event.tag.encode())

    async def close(self, timeout: float = 5.0) -> None:
        """Flush and disconnect, giving up after ``timeout`` seconds (a broker that is down never answers)."""
        if self._producer is not None:
            producer, self._producer = self._producer, None
            try:
                await asyncio.wait_for(producer.stop(), timeout)
            except (KafkaError, TimeoutError) as exc:
                log.debug("closing the rate producer: %s", exc or "timed out")
