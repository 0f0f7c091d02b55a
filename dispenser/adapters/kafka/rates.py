"""The peers' rate events from the Kafka rate topic: how a Kafka-only worker (NATS off) hears its fleet.

Every worker with Kafka on publishes its rate events to ``rate.kafka_topic`` (:class:`KafkaRateSink
<dispenser.adapters.kafka.clients.KafkaRateSink>`). :class:`KafkaRateListener` reads every partition of
that topic, outside any consumer group (each worker must see every event), from its end at start-up:
an old event would make a peer that has long gone look alive, since a peer counts as live for
``rate.stale_after`` seconds after its last event *was received*.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from dispenser.adapters.kafka.clients import client_options, ensure_topics, topic_partitions
from dispenser.config import KafkaConfig
from dispenser.messages import RateEvent

__all__ = ["KafkaRateListener"]

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
