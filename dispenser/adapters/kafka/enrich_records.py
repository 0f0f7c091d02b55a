"""What an enricher writes besides the records: the headers it adds, and producer batches built by hand.

Part of :mod:`~dispenser.adapters.kafka.enrich`; the headers are described in ``docs/kafka.md`` ("Stream enrichment").
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaProducer, ConsumerRecord

from dispenser.adapters.kafka.headers import (
    ERROR_CODE_HEADER,
    ERROR_MESSAGE_HEADER,
    SOURCE_HEADER,
    SOURCE_OFFSET_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
)
from dispenser.service.enrichment import Rejection

__all__ = [
    "ERROR_CODE_HEADER",
    "ERROR_MESSAGE_HEADER",
    "SOURCE_HEADER",
    "SOURCE_OFFSET_HEADER",
    "SOURCE_PARTITION_HEADER",
    "SOURCE_TOPIC_HEADER",
    "Batches",
    "dead_headers",
]


class Batches:
    """Records for one topic partition, appended to producer batches and sent a batch at a time.

    aiokafka's per-record ``send`` creates a future and looks the partition up for every record; a batch
    builder does that once per batch, which is most of the producer's cost per record here.
    """

    __slots__ = ("_batch", "_partition", "_producer", "_topic", "count", "futures")

    def __init__(self, producer: AIOKafkaProducer, topic: str, partition: int) -> None:
        self._producer = producer
        self._topic = topic
        self._partition = partition
        self._batch: Any = None
        self.count = 0
        self.futures: list[asyncio.Future[object]] = []

    def try_add(
        self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], timestamp: int
    ) -> bool:
        """Append a record to the current batch if there is one with room (no await: the common case)."""
        batch = self._batch
        if batch is None or batch.append(key=key, value=value, timestamp=timestamp, headers=headers) is None:
            return False
        self.count += 1
        return True

    async def add(
        self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], timestamp: int
    ) -> None:
        """Append a record (``timestamp``: ms since 1970), sending the current batch first if it is full."""
        self.count += 1
        if self._batch is None:
            self._batch = self._producer.create_batch()
        elif self._batch.append(key=key, value=value, timestamp=timestamp, headers=headers) is not None:
            return
        else:
            await self._send()
            self._batch = self._producer.create_batch()
        if self._batch.append(key=key, value=value, timestamp=timestamp, headers=headers) is None:
            raise ValueError(f"a record of {len(value or b'')} bytes does not fit an empty producer batch")

    async def flush(self) -> list[asyncio.Future[object]]:
        """Send what is left; the delivery futures of every batch sent."""
        if self._batch is not None:
            await self._send()
            self._batch = None
        return self.futures

    async def _send(self) -> None:
        self.futures.append(
            await self._producer.send_batch(self._batch, self._topic, partition=self._partition)
        )


def dead_headers(
    record: ConsumerRecord[bytes, bytes], rejection: Rejection, where: bytes
) -> list[tuple[str, bytes]]:
    """The headers of a dead letter: the record's own, then why and where it came from."""
    return [
        *record.headers,
        (ERROR_CODE_HEADER, rejection.code.encode()),
        (ERROR_MESSAGE_HEADER, rejection.message.encode()),
        (SOURCE_TOPIC_HEADER, record.topic.encode()),
        (SOURCE_PARTITION_HEADER, str(record.partition).encode()),
        (SOURCE_OFFSET_HEADER, str(record.offset).encode()),
        (SOURCE_HEADER, where + str(record.offset).encode()),
    ]
