"""``dispenser enrich``: consume a topic, give every record an ID, produce it, exactly once.

One transactional producer per input partition (``<prefix>.<partition>``) writes that partition's
outputs, dead letters and consumed offset in one transaction; a new owner fences the previous one, then
reads the offset strictly (:mod:`~dispenser.adapters.kafka.offsets`). Why it holds, the order kept and
the dead letters: ``docs/kafka.md`` ("Stream enrichment").

The transaction and take-over machinery is :mod:`~dispenser.adapters.kafka.enrich_transactions`, the
settings :mod:`~dispenser.adapters.kafka.enrich_settings`, the headers and batches
:mod:`~dispenser.adapters.kafka.enrich_records`; their public names are importable from here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from dispenser.adapters.kafka.connection import (
    check_security,
    client_options,
    ensure_topics,
    topic_partitions,
)
from dispenser.adapters.kafka.enrich_records import (
    ERROR_CODE_HEADER,
    ERROR_MESSAGE_HEADER,
    SOURCE_HEADER,
    SOURCE_OFFSET_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
    Batches,
    dead_headers,
)
from dispenser.adapters.kafka.enrich_settings import EnrichSettings, EnrichStats
from dispenser.adapters.kafka.enrich_transactions import (
    RETRY_MAX,
    STOP_GRACE,
    OwnedPartition,
    PartitionOwner,
    begin_transaction,
    seconds_left,
)
from dispenser.config import KafkaConfig
from dispenser.core.errors import DispenserError
from dispenser.ports import IdSource
from dispenser.service.enrichment import Rejection, transformer
from dispenser.service.retry import Backoff, Stopped

__all__ = [
    "ERROR_CODE_HEADER",
    "ERROR_MESSAGE_HEADER",
    "SOURCE_HEADER",
    "SOURCE_OFFSET_HEADER",
    "SOURCE_PARTITION_HEADER",
    "SOURCE_TOPIC_HEADER",
    "EnrichSettings",
    "EnrichStats",
    "Enricher",
]

log = logging.getLogger(__name__)

_FINISH_GRACE = 1.0
"""Seconds a stop gives the fetch under way to finish (then to be committed) before cancelling it."""


class Enricher(PartitionOwner):
    """Consume-enrich-produce in Kafka transactions, one transactional producer per input partition."""

    def __init__(self, kafka: KafkaConfig, settings: EnrichSettings, source: IdSource) -> None:
        super().__init__(kafka, settings)
        self._source = source
        self._transform = transformer(settings.placement, settings.max_record_bytes)

    async def start(self) -> None:
        """Check the topics (creating the output and dead-letter ones if configured) and join the group.

        Raises:
            OSError: Kafka could not be reached, or the input topic does not exist.
        """
        settings, kafka = self.settings, self._kafka
        await check_security(kafka)
        partitions = await topic_partitions(kafka, settings.input_topic)
        if kafka.create_topics:
            await ensure_topics(kafka, {settings.output_topic: partitions, settings.dlq: partitions})
        self._out_partitions = await topic_partitions(kafka, settings.output_topic)
        self._dlq_partitions = await topic_partitions(kafka, settings.dlq)
        self._consumer = AIOKafkaConsumer(
            **client_options(kafka),
            group_id=settings.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # Outputs of aborted transactions upstream must not be enriched either.
            isolation_level="read_committed",
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=kafka.heartbeat_interval_ms,
            max_partition_fetch_bytes=max(1_048_576, settings.max_record_bytes + 4096),
        )
        self._consumer.subscribe([settings.input_topic], listener=_Listener(self))
        try:
            await self._consumer.start()
        except KafkaError as exc:
            await self.close()
            raise OSError(f"cannot reach Kafka at {kafka.bootstrap_servers}: {exc}") from exc
        log.info(
            "enriching %s -> %s (dead letters: %s) with %s IDs of tag %r in the %s; group %r",
            settings.input_topic,
            settings.output_topic,
            settings.dlq,
            settings.kind,
            settings.tag,
            settings.placement.describe(),
            settings.group,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Enrich until ``stop`` is set; then commit what is under way and leave the group.

        A stop while the enricher waits for IDs (PostgreSQL down) or for Kafka does not wait for them: the
        work under way is given up (cancelled after :data:`_FINISH_GRACE` at most), its open transactions
        are aborted rather than committed (the next owner enriches their records again, from the last
        commit), and each step of winding down is bounded (:data:`STOP_GRACE`).
        """
        if self._consumer is None:
            raise RuntimeError("Enricher.run() before start()")
        self._stop = stop
        work = asyncio.create_task(self._loop(self._consumer), name="enrich")
        stopping = asyncio.create_task(stop.wait(), name="enrich-stop")
        try:
            await asyncio.wait((work, stopping), return_when=asyncio.FIRST_COMPLETED)
            # Stop requested: the loop ends after the fetch under way, unless it is stuck waiting.
            await asyncio.wait((work,), timeout=_FINISH_GRACE)
        finally:
            stopping.cancel()
            if not work.done():
                work.cancel()
            finished = await asyncio.gather(work, return_exceptions=True)
        interrupted = work.cancelled() or isinstance(finished[0], Stopped)
        if interrupted:
            log.info("stopped while waiting (for IDs or for Kafka): aborting the open transactions")
        elif isinstance(finished[0], BaseException):
            await self.close(commit=False)
            raise finished[0]
        await self.close(commit=not interrupted)

    async def _loop(self, consumer: AIOKafkaConsumer) -> None:
        # Short polls: a long getmany timeout slows aiokafka's hand-over of fetched records (measured: ~20 ms a
        # call at 1 s, a third of the throughput), and the loop must wake up to commit on time anyway.
        timeout_ms = max(1, int(min(self.settings.commit_interval, 0.1) * 1000))
        backoff = Backoff(0.5, 0.5, stop=self._stop)
        while not self._stop.is_set():
            if self._failure is not None:
                raise self._failure
            try:
                fetched = await consumer.getmany(
                    timeout_ms=timeout_ms, max_records=self.settings.commit_records
                )
            except KafkaError as exc:
                log.warning("Kafka consumer: %s", exc)
                await backoff.wait()
                continue
            await self._enrich(fetched)

    async def _enrich(self, fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        """Process one fetch, partition by partition, and commit the transactions that are due."""
        async with self._lock:
            for tp, records in fetched.items():
                part = self._partitions.get(tp)
                if part is not None:  # else revoked since the fetch: the new owner reads them again
                    await self._guarded(part, self._process(part, records))
            # Fewer records than asked for: nothing more is buffered, so waiting for more would only add
            # a fetch round trip to this transaction. Commit now (lower latency, same batching at load).
            caught_up = sum(len(records) for records in fetched.values()) < self.settings.commit_records
            await self._commit_due(caught_up)

    async def close(self, *, commit: bool = True) -> None:
        """Commit (or abort) the open transactions, stop every producer and leave the group.

        Winding down gets :data:`STOP_GRACE` seconds in all; past it, each further step is given up on
        at once. A transaction neither committed nor aborted then is left to the broker, which aborts it
        when the partition's next owner starts its producer (or at the transaction timeout): none of it is
        ever read as committed.

        Args:
            commit: commit the open transactions (the normal stop); false: abort them (the work under
                way was interrupted, so a transaction may hold records whose offsets it does not cover).
        """
        self._stop.set()  # a take-over still retrying gives up
        deadline = time.monotonic() + STOP_GRACE
        taking = list(self._taking.values())
        for task in taking:
            task.cancel()
        if taking:
            await asyncio.wait(taking, timeout=seconds_left(deadline))
        async with self._lock:
            parts, self._partitions = list(self._partitions.values()), {}
            for part in parts:
                await self._wind_down(part, commit, deadline)
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), seconds_left(deadline))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._offsets.close(), seconds_left(deadline))

    def lag(self) -> dict[int, int]:
        """Records behind, by owned input partition.

        The partition's last stable offset (what ``read_committed`` may read, as the consumer last heard it
        from the broker) minus the next offset this enricher reads. A partition whose end the consumer has not heard yet (just assigned) is left out.
        """
        consumer = self._consumer
        if consumer is None:
            return {}
        behind = {}
        for tp, part in list(self._partitions.items()):
            end = consumer.last_stable_offset(tp)
            if end is None:
                end = consumer.highwater(tp)
            if end is not None:
                behind[tp.partition] = max(0, end - part.next_offset)
        return behind

    # -- the work ----------------------------------------------------------------------------------------

    async def _process(self, part: OwnedPartition, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        settings = self.settings
        if records[0].offset < part.next_offset:
            records = [r for r in records if r.offset >= part.next_offset]
            if not records:
                return
        if not part.in_transaction:
            await self._decided(part)
        # One ID per record, taken before knowing which records will be rejected: a rejected record's ID is
        # skipped (never reissued), and the batch costs one call to the ID source.
        next_id = (await self._take(len(records))).__next__
        producer = part.producer
        part.half_done = True  # until next_offset covers this batch (a stop may cancel us half-way)
        if not part.in_transaction:
            await begin_transaction(producer)
            part.in_transaction = True
            part.started = time.monotonic()
        tp = part.tp
        out_tp, dead_tp = part.outputs  # worked out once, at the take-over
        out = Batches(producer, out_tp.topic, out_tp.partition)
        dead = Batches(producer, dead_tp.topic, dead_tp.partition)
        where = f"{tp.topic}/{tp.partition}/".encode()
        transform, source_header = self._transform, settings.source_header
        for record in records:
            headers = list(record.headers)
            if source_header:
                headers.append((SOURCE_HEADER, where + str(record.offset).encode()))
            enriched = transform(record.key, record.value, headers, next_id())
            # Outputs and dead letters keep the input record's timestamp (Kafka's convention for a record
            # derived from another: event time survives the hop; the broker's own time is in the log anyway).
            stamp = record.timestamp
            if isinstance(enriched, Rejection):
                await dead.add(record.key, record.value, dead_headers(record, enriched, where), stamp)
            elif not out.try_add(enriched.key, enriched.value, enriched.headers, stamp):
                await out.add(enriched.key, enriched.value, enriched.headers, stamp)
        part.sends += await out.flush()
        part.sends += await dead.flush()
        part.dead += dead.count
        part.pending += len(records)
        part.next_offset = records[-1].offset + 1
        part.half_done = False

    async def _take(self, count: int) -> Iterator[int]:
        """``count`` IDs in increasing order, retrying for as long as the source cannot supply them.

        Raises:
            Stopped: the enricher was asked to stop while it waited.
        """
        tag, fetch_deadline = self.settings.tag, self.settings.fetch_deadline
        backoff: Backoff | None = None  # the common case, IDs at hand, needs none
        while True:
            work = self._source.take(tag, count, time.monotonic() + fetch_deadline)
            try:
                batch = await (work if backoff is None else backoff.attempt(work))
            except DispenserError as exc:
                self.stats.id_waits += 1
                log.warning("cannot take %d IDs of tag %r yet (%s); retrying", count, tag, exc)
                backoff = backoff or Backoff(0.1, RETRY_MAX, stop=self._stop)
                await backoff.wait()
                continue
            return itertools.chain.from_iterable(range(first, last + 1) for first, last in batch.ranges)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """Hands rebalances to the enricher (aiokafka awaits these before it fetches again)."""

    def __init__(self, enricher: Enricher) -> None:
        self._enricher = enricher

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self._enricher._revoked(revoked)

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self._enricher._assigned(assigned)
