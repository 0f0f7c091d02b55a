"""The Kafka clients ``dispenser bench kafka`` measures with: the requester and the baseline copy loop.

:class:`Requester` sends requests and matches their replies by correlation ID, :func:`drive` keeps a number
of them in flight for a while, and :class:`CopyLoop` is the enricher's baseline (a transactional copy with
no IDs); :func:`timed_rate` times either loop. The runner: :mod:`~dispenser_lab.bench.kafka_bench`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from dispenser.adapters.kafka.connection import CORRELATION_ID, REPLY_TOPIC, header

__all__ = ["BODY", "TAG", "CopyLoop", "Requester", "drive", "timed_rate", "unique"]

TAG = "bench"
"""The tag every request asks for (and the enricher assigns from)."""
BODY = b'{"tag": "bench", "count": 1}'
"""The request body: one ID of :data:`TAG`."""


def unique(name: str) -> str:
    """A fresh topic or group name: ``bench.<name>.<8 hex digits>``."""
    return f"bench.{name}.{uuid.uuid4().hex[:8]}"


class Requester:
    """One producer and one reply consumer; any number of requests in flight, matched by correlation ID."""

    def __init__(self, bootstrap: str, request_topic: str, reply_topic: str) -> None:
        self.request_topic = request_topic
        self.reply_topic = reply_topic
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks=1, linger_ms=0, retry_backoff_ms=10
        )
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
        )
        self._pending: dict[bytes, asyncio.Future[bytes]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._headers_base = [(REPLY_TOPIC, reply_topic.encode())]
        self.errors = 0

    async def start(self) -> None:
        """Connect and read the reply topic from its end."""
        await self._producer.start()
        await self._consumer.start()
        tp = TopicPartition(self.reply_topic, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_end(tp)
        await self._consumer.position(tp)
        self._reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        """Close both clients."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._consumer.stop()
        await self._producer.stop()

    async def _read(self) -> None:
        while True:
            fetched = await self._consumer.getmany(timeout_ms=500)
            for records in fetched.values():
                for record in records:
                    future = self._pending.pop(header(record.headers, CORRELATION_ID) or b"", None)
                    if future is not None and not future.done():
                        future.set_result(record.value or b"")

    async def ask(self, body: bytes, timeout: float = 30.0) -> bytes:
        """One request, awaited."""
        correlation = uuid.uuid4().bytes
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = future
        await self._producer.send(
            self.request_topic,
            body,
            key=TAG.encode(),
            headers=[*self._headers_base, (CORRELATION_ID, correlation)],
        )
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(correlation, None)


async def drive(requester: Requester, inflight: int, seconds: float) -> tuple[int, list[int], float]:
    """``inflight`` coroutines asking in a loop for ``seconds``; returns (replies, latencies in ns, elapsed)."""
    latencies: list[int] = []
    end = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < end:
            started = time.perf_counter_ns()
            reply = await requester.ask(BODY)
            latencies.append(time.perf_counter_ns() - started)
            if b'"error"' in reply:
                requester.errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(inflight)))
    return len(latencies), latencies, time.perf_counter() - started


class CopyLoop:
    """The baseline: a transactional copy loop with no ID assignment (what the enricher does, minus IDs)."""

    def __init__(self, bootstrap: str, source: str, target: str, commit_records: int) -> None:
        self.source, self.target, self.commit_records = source, target, commit_records
        self.group = unique("copy")
        self.committed = 0
        self._consumer = AIOKafkaConsumer(
            source,
            bootstrap_servers=bootstrap,
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            transactional_id=self.group,
            enable_idempotence=True,
            acks="all",
            linger_ms=5,
            retry_backoff_ms=10,
            max_batch_size=262_144,
        )

    async def run(self, total: int) -> None:
        """Copy until ``total`` records are committed."""
        await self._producer.start()
        await self._consumer.start()
        try:
            while self.committed < total:
                fetched = await self._consumer.getmany(timeout_ms=100, max_records=self.commit_records)
                if not fetched:
                    continue
                await self._producer.begin_transaction()
                offsets = {}
                sends = []
                copied = 0
                for tp, records in fetched.items():
                    # Producer batches built here, as the enricher does (aiokafka's per-record send costs more).
                    batch = self._producer.create_batch()
                    for record in records:
                        if (
                            batch.append(
                                key=record.key,
                                value=record.value,
                                timestamp=None,
                                headers=list(record.headers),
                            )
                            is None
                        ):
                            sends.append(
                                await self._producer.send_batch(batch, self.target, partition=tp.partition)
                            )
                            batch = self._producer.create_batch()
                            batch.append(
                                key=record.key,
                                value=record.value,
                                timestamp=None,
                                headers=list(record.headers),
                            )
                    sends.append(await self._producer.send_batch(batch, self.target, partition=tp.partition))
                    offsets[tp] = records[-1].offset + 1
                    copied += len(records)
                await asyncio.gather(*sends)
                await self._producer.send_offsets_to_transaction(offsets, self.group)
                await self._producer.commit_transaction()
                self.committed += copied
        finally:
            await self._consumer.stop()
            await self._producer.stop()


async def timed_rate(progress: Callable[[], int], total: int, work: asyncio.Task[None]) -> float:
    """Records per second from the first commit (``progress()`` > 0) to ``total`` committed."""
    first_at = first_count = None
    while progress() < total:
        if work.done():
            work.result()
            raise RuntimeError("the loop stopped before it was done")
        count = progress()
        if first_at is None and count > 0:
            first_at, first_count = time.perf_counter(), count
        await asyncio.sleep(0.002)
    if first_at is None or first_count is None:
        raise RuntimeError("everything was committed in one transaction: use more records")
    return (total - first_count) / (time.perf_counter() - first_at)
