"""``dispenser enrich``: consume a topic, give every record an ID, produce it, exactly once.

One transactional producer per input partition (``<prefix>.<partition>``) writes that partition's
outputs, dead letters and consumed offset in one transaction; a new owner fences the previous one, then
reads the offset strictly (:mod:`~dispenser.adapters.kafka.offsets`). Why it holds, the order kept and
the dead letters: ``docs/kafka.md`` ("Stream enrichment").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import IllegalOperation, KafkaConnectionError, KafkaError, ProducerFenced

from dispenser.adapters.kafka.clients import check_security, client_options, ensure_topics, topic_partitions
from dispenser.adapters.kafka.offsets import CommittedOffsets, HangingTransaction
from dispenser.config import EnrichConfig, KafkaConfig
from dispenser.core.errors import DispenserError
from dispenser.messages import Kind
from dispenser.ports import IdSource
from dispenser.service.enrichment import Placement, Rejection, transformer
from dispenser.service.retry import Backoff, Stopped

__all__ = ["EnrichSettings", "EnrichStats", "Enricher"]

log = logging.getLogger(__name__)

SOURCE_HEADER = "leaf-source"
"""Added to every output and dead letter: ``<topic>/<partition>/<offset>`` of the input record."""
ERROR_CODE_HEADER = "leaf-error-code"
ERROR_MESSAGE_HEADER = "leaf-error-message"
SOURCE_TOPIC_HEADER = "leaf-source-topic"
SOURCE_PARTITION_HEADER = "leaf-source-partition"
SOURCE_OFFSET_HEADER = "leaf-source-offset"

_RETRY_MAX = 5.0
_FINISH_GRACE = 1.0
"""Seconds a stop gives the fetch under way to finish (then to be committed) before cancelling it."""
_STOP_GRACE = 3.0
"""Seconds a stop gives winding down (commit or abort, closing the producers, leaving the group) before it
gives up on each further step: a broker that is down must not keep the process alive."""
_DECIDED_WAIT = 2.0
"""Seconds a partition's next transaction waits for its last one's markers (ms, usually) before the partition is
taken over again, which waits on without holding up the others (see :meth:`Enricher._decided`)."""
_DECIDED_POLL = 0.005


@dataclass(frozen=True, slots=True)
class EnrichSettings:
    """One enrichment stream: topics, where the ID goes, which tag and generator, and the batching."""

    input_topic: str
    output_topic: str
    tag: str
    placement: Placement
    kind: Kind = "segment"
    """Which generator gives the IDs."""
    dlq_topic: str | None = None
    """Default ``<input>.dlq``."""
    group_id: str | None = None
    """Default ``leaf-enrich.<input>``."""
    transactional_id_prefix: str | None = None
    """Default: the group ID."""
    commit_records: int = 1000
    commit_interval: float = 0.1
    max_record_bytes: int = 1_000_000
    transaction_timeout_ms: int = 60_000
    source_header: bool = True
    """Add ``leaf-source: <topic>/<partition>/<offset>`` to every output (dead letters always get it)."""
    fetch_deadline: float = 2.0
    """Seconds one attempt to take IDs may wait before it is retried."""

    @classmethod
    def build(cls, config: EnrichConfig, **stream: object) -> EnrichSettings:
        """Settings from the ``[enrich]`` section plus the stream's own (CLI) options."""
        return cls(
            group_id=config.group_id,
            transactional_id_prefix=config.transactional_id_prefix,
            commit_records=config.commit_records,
            commit_interval=config.commit_interval,
            max_record_bytes=config.max_record_bytes,
            transaction_timeout_ms=config.transaction_timeout_ms,
            source_header=config.source_header,
            **stream,  # type: ignore[arg-type]
        )

    @property
    def dlq(self) -> str:
        """The dead-letter topic."""
        return self.dlq_topic or f"{self.input_topic}.dlq"

    @property
    def group(self) -> str:
        """The consumer group of this stream's enrichers."""
        return self.group_id or f"leaf-enrich.{self.input_topic}"

    def transactional_id(self, partition: int) -> str:
        """The stable transactional ID of the producer that owns input ``partition``."""
        return f"{self.transactional_id_prefix or self.group}.{partition}"


@dataclass
class EnrichStats:
    """What the enricher did (records counted when their transaction commits)."""

    enriched: int = 0
    dead_lettered: int = 0
    transactions: int = 0
    aborted: int = 0
    id_waits: int = 0
    """Times taking IDs failed and was retried (store unavailable, unknown tag…)."""


class _Partition:
    """The state of one owned input partition: its producer and the transaction under way."""

    __slots__ = (
        "dead",
        "half_done",
        "in_transaction",
        "next_offset",
        "outputs",
        "pending",
        "producer",
        "sends",
        "started",
        "tp",
        "unsure",
    )

    def __init__(
        self, tp: TopicPartition, producer: AIOKafkaProducer, outputs: tuple[TopicPartition, TopicPartition]
    ) -> None:
        self.tp = tp
        self.producer = producer
        self.outputs = outputs
        """The output and dead-letter partitions this partition's records go to."""
        self.in_transaction = False
        self.pending = 0
        """Records in the open transaction (enriched and dead-lettered)."""
        self.dead = 0
        """Dead letters in the open transaction."""
        self.next_offset = 0
        self.started = 0.0
        self.sends: list[asyncio.Future[object]] = []
        self.half_done = False
        """A batch is being sent: the transaction holds records past ``next_offset`` (never commit it)."""
        self.unsure: set[TopicPartition] = set()
        """Output partitions the last committed transaction wrote to, until seen decided there
        (:meth:`Enricher._decided`)."""


class Enricher:
    """Consume-enrich-produce in Kafka transactions, one transactional producer per input partition."""

    def __init__(self, kafka: KafkaConfig, settings: EnrichSettings, source: IdSource) -> None:
        self._kafka = kafka
        self.settings = settings
        self._source = source
        self.stats = EnrichStats()
        self._consumer: AIOKafkaConsumer | None = None
        self._offsets = CommittedOffsets(kafka, settings.group)
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._taking: dict[TopicPartition, asyncio.Task[None]] = {}
        """Take-overs under way (the partition paused meanwhile): see :meth:`_take_over`."""
        self._failure: BaseException | None = None
        """What ended a take-over unexpectedly (a bug, not Kafka): :meth:`run` raises it."""
        self._lock = asyncio.Lock()
        self._out_partitions = 1
        self._dlq_partitions = 1
        self._transform = transformer(settings.placement, settings.max_record_bytes)
        self._stop = asyncio.Event()
        """Set by :meth:`run`'s caller: the retry loops (IDs, taking over a partition) end at once."""

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
        commit), and each step of winding down is bounded (:data:`_STOP_GRACE`).
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

        Winding down gets :data:`_STOP_GRACE` seconds in all; past it, each further step is given up on
        at once. A transaction neither committed nor aborted then is left to the broker, which aborts it
        when the partition's next owner starts its producer (or at the transaction timeout): none of it is
        ever read as committed.

        Args:
            commit: commit the open transactions (the normal stop); false: abort them (the work under
                way was interrupted, so a transaction may hold records whose offsets it does not cover).
        """
        self._stop.set()  # a take-over still retrying gives up
        deadline = time.monotonic() + _STOP_GRACE
        taking = list(self._taking.values())
        for task in taking:
            task.cancel()
        if taking:
            await asyncio.wait(taking, timeout=_left(deadline))
        async with self._lock:
            parts, self._partitions = list(self._partitions.values()), {}
            for part in parts:
                await self._wind_down(part, commit, deadline)
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), _left(deadline))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._offsets.close(), _left(deadline))

    async def _wind_down(self, part: _Partition, commit: bool, deadline: float) -> None:
        """End ``part``'s open transaction (committed if asked and possible in time, else aborted); stop its producer.

        Never raises: a producer whose commit was cancelled half-way may refuse even to abort (aiokafka
        then raises whatever its state machine says); the broker aborts for it, as after a crash.
        """
        name = _name(part.tp)
        if part.in_transaction and commit and not part.half_done:
            try:
                await asyncio.wait_for(self._commit(part), _left(deadline))
            except Exception as exc:  # any failure: abort instead
                log.warning("%s: could not commit on stop (%s); aborting", name, _why(exc))
        if part.in_transaction:
            try:
                await asyncio.wait_for(part.producer.abort_transaction(), _left(deadline))
            except Exception as exc:  # any failure: the broker aborts it
                log.warning("%s: could not abort on stop (%s); the broker will", name, _why(exc))
            else:
                self.stats.aborted += 1
                log.info("%s: aborted the open transaction (%d records)", name, part.pending)
            part.in_transaction = False
        await _stop_producer(part.producer, _left(deadline))

    # -- partitions come and go ------------------------------------------------------------------------

    async def _assigned(self, assigned: Sequence[TopicPartition]) -> None:
        async with self._lock:
            if self._stop.is_set() or self._consumer is None:  # a rejoin while closing: take nothing over
                return
            for tp in sorted(assigned):
                if tp not in self._partitions:
                    self._take_over(tp)

    async def _revoked(self, revoked: Sequence[TopicPartition]) -> None:
        async with self._lock:
            for tp in revoked:
                taking = self._taking.pop(tp, None)
                if taking is not None:  # not ours any more: its producer is stopped as the task ends
                    taking.cancel()
                part = self._partitions.pop(tp, None)
                if part is not None:
                    # A failed commit is not retried here: the partition is no longer ours, and taking it
                    # over again would fence its next owner. That owner's take-over aborts what is left.
                    await self._guarded(part, self._commit(part), take_over=False)
                    await self._release(part)

    def _take_over(self, tp: TopicPartition) -> None:
        """Take ``tp`` over in a task of its own; ``tp`` stays paused until it is done.

        Not inline, in the rebalance callback or in the loop, under the lock: a take-over may wait for
        long (the coordinator loading after a restart, the previous owner's transaction being aborted, a
        hanging transaction on an output partition), and meanwhile every other partition would wait too,
        uncommitted, and the consumer would send no heartbeat (aiokafka starts them after the callback):
        the group would drop it after the session timeout and rebalance again.
        """
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("taking over a partition before start()")
        under_way = self._taking.get(tp)
        if under_way is not None and not under_way.done():
            return
        consumer.pause(tp)  # records fetched before the take-over's seek are not ours to enrich
        task = asyncio.create_task(self._own(tp), name=f"take over {_name(tp)}")
        self._taking[tp] = task
        task.add_done_callback(functools.partial(self._took_over, tp))

    def _took_over(self, tp: TopicPartition, task: asyncio.Task[None]) -> None:
        if self._taking.get(tp) is task:
            del self._taking[tp]
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, Stopped) and self._failure is None:
            log.error("taking over %s failed", _name(tp), exc_info=error)
            self._failure = error

    async def _own(self, tp: TopicPartition) -> None:
        """Take over ``tp``: fence its previous owner, then resume after its last committed transaction."""
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("taking over a partition before start()")
        backoff = Backoff(0.2, _RETRY_MAX, stop=self._stop)
        while True:
            # A new producer for each attempt: once stopped, an AIOKafkaProducer started again could never be
            # stopped (its stop() is a no-op after the first), leaking its connections and sender task.
            producer = self._producer(tp)
            try:
                # start() runs InitProducerId: the broker aborts the previous owner's open transaction
                # and bumps the epoch, so the previous owner can no longer commit.
                await backoff.attempt(_start(producer))
                # The previous owner's last transaction may still be pending (acknowledged, its markers not
                # all written: seen for seconds after a broker kill -9) although the fence is up: wait
                # until every transaction on our output partitions is decided before reading the offset.
                waited = await self._settled(tp, backoff)
                if waited > 1.0:
                    log.info("%s: waited %.1f s for open transactions to be decided", _name(tp), waited)
                # Not consumer.committed(): it answers None ("never committed") while the coordinator is
                # still loading after a broker restart, and the partition would start over (see offsets.py).
                committed = await backoff.attempt(self._offsets.committed(tp))
                break
            except KafkaError as exc:
                await _stop_producer(producer)
                log.warning("cannot take over %s yet: %s", _name(tp), exc)
                try:
                    await backoff.wait()
                except Stopped:
                    log.info("stopping: leaving %s to its next owner", _name(tp))
                    raise
            except BaseException:  # stopping (Stopped, cancelled) half-way through a start
                await _stop_producer(producer)
                raise
        try:
            async with self._lock:
                if self._stop.is_set() or tp not in consumer.assignment():
                    await _stop_producer(producer)  # revoked (or closing) meanwhile: not ours to enrich
                    return
                if committed is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, committed)
                part = _Partition(tp, producer, self._outputs_of(tp))
                # Records fetched before this take-over (a stale getmany result) are below this and skipped.
                part.next_offset = 0 if committed is None else committed
                self._partitions[tp] = part
                consumer.resume(tp)
        except BaseException:  # cancelled (closing) before the partition was ours
            if self._partitions.get(tp) is None:
                await _stop_producer(producer)
            raise
        log.info(
            "enriching %s from offset %s", _name(tp), "the beginning" if committed is None else committed
        )

    async def _settled(self, tp: TopicPartition, backoff: Backoff) -> float:
        """Wait until every transaction on ``tp``'s output partitions is decided; the seconds waited.

        A hanging transaction (undecided past the transaction timeout; ``offsets.settled`` logs it) is
        waited for on and on, never written over: this producer ID's next marker on that partition would
        decide it too (an abort dropping records whose offsets were committed, a commit publishing
        aborted ones). Only ``tp`` waits; the enricher's other partitions go on.
        """
        began = time.monotonic()
        timeout = self.settings.transaction_timeout_ms / 1000
        while True:
            try:
                await backoff.attempt(self._offsets.settled(self._outputs_of(tp), timeout))
            except HangingTransaction:
                continue
            return time.monotonic() - began

    def _outputs_of(self, tp: TopicPartition) -> tuple[TopicPartition, TopicPartition]:
        """The output and dead-letter partitions that input partition ``tp``'s records go to."""
        settings = self.settings
        return (
            TopicPartition(settings.output_topic, tp.partition % self._out_partitions),
            TopicPartition(settings.dlq, tp.partition % self._dlq_partitions),
        )

    def _producer(self, tp: TopicPartition) -> AIOKafkaProducer:
        """A new transactional producer for input partition ``tp`` (not started)."""
        return AIOKafkaProducer(
            **client_options(self._kafka),
            transactional_id=self.settings.transactional_id(tp.partition),
            transaction_timeout_ms=self.settings.transaction_timeout_ms,
            enable_idempotence=True,
            acks="all",
            linger_ms=5,
            # Batches are built here (see _Batches); one may hold the largest record allowed.
            max_batch_size=max(262_144, self.settings.max_record_bytes + 65_536),
            max_request_size=max(1_048_576, self.settings.max_record_bytes + 65_536),
        )

    async def _release(self, part: _Partition) -> None:
        await _stop_producer(part.producer)

    # -- the work ----------------------------------------------------------------------------------------

    async def _process(self, part: _Partition, records: list[ConsumerRecord[bytes, bytes]]) -> None:
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
            await _begin(producer)
            part.in_transaction = True
            part.started = time.monotonic()
        tp = part.tp
        out_tp, dead_tp = part.outputs  # worked out once, at the take-over
        out = _Batches(producer, out_tp.topic, out_tp.partition)
        dead = _Batches(producer, dead_tp.topic, dead_tp.partition)
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
                await dead.add(record.key, record.value, _dead_headers(record, enriched, where), stamp)
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
                backoff = backoff or Backoff(0.1, _RETRY_MAX, stop=self._stop)
                await backoff.wait()
                continue
            return itertools.chain.from_iterable(range(first, last + 1) for first, last in batch.ranges)

    async def _commit_due(self, caught_up: bool) -> None:
        now = time.monotonic()
        settings = self.settings
        for part in list(self._partitions.values()):
            if part.in_transaction and (
                caught_up
                or part.pending >= settings.commit_records
                or now - part.started >= settings.commit_interval
            ):
                await self._guarded(part, self._commit(part))

    async def _commit(self, part: _Partition) -> None:
        if not part.in_transaction:
            return
        sent: list[Any] = await asyncio.gather(*part.sends)  # aiokafka's RecordMetadata, one a batch
        await part.producer.send_offsets_to_transaction({part.tp: part.next_offset}, self.settings.group)
        await part.producer.commit_transaction()
        self._count_committed(part)
        part.in_transaction = False
        part.pending = part.dead = 0
        part.sends = []
        part.unsure.update(TopicPartition(batch.topic, batch.partition) for batch in sent)

    async def _decided(self, part: _Partition) -> None:
        """Wait until the last transaction ``part`` committed is decided (its markers written) where it wrote.

        The coordinator writes the markers after the commit returns; a broker restart in between may drop
        some for good (``docs/kafka.md``, hanging transactions) while the coordinator takes the transaction
        for done. Written over by this producer ID, such a partition would have the undecided records
        decided by our next marker there: an abort would drop dead letters or outputs whose offsets were
        committed (as the restart test once saw two dead letters go), a commit would publish records of
        aborted transactions. So a transaction begins only once the previous one is decided everywhere it wrote
        (usually at once: the markers take milliseconds, and the coordinator would make the first write
        of this transaction wait for them anyway).

        Raises:
            HangingTransaction: Still undecided after :data:`_DECIDED_WAIT` seconds: the caller takes the
                partition over again, which waits for it without holding up the other partitions.
            KafkaError: A partition's end could not be read.
        """
        deadline = time.monotonic() + _DECIDED_WAIT
        while part.unsure:
            for where in list(part.unsure):
                # Our producer alone writes there: below the end, everything is ours, and all decided
                # once the last stable offset reaches it.
                end = await self._offsets.end(where, stable=False)
                if await self._offsets.end(where, stable=True) >= end:
                    part.unsure.discard(where)
            if not part.unsure:
                return
            if time.monotonic() > deadline:
                raise HangingTransaction(
                    f"the last transaction of {_name(part.tp)} is still undecided on"
                    f" {', '.join(_name(where) for where in sorted(part.unsure))} after {_DECIDED_WAIT:g} s"
                )
            await asyncio.sleep(_DECIDED_POLL)

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

    def _count_committed(self, part: _Partition) -> None:
        stats = self.stats
        stats.transactions += 1
        stats.dead_lettered += part.dead
        stats.enriched += part.pending - part.dead

    async def _guarded(self, part: _Partition, work: object, *, take_over: bool = True) -> None:
        """Run ``work`` on ``part``; on a Kafka failure, abort and start the partition over from its commit.

        Args:
            part: the partition the work is for.
            work: an awaitable (processing a batch, or a commit).
            take_over: after a failure, take the partition over again (it is still assigned to us); false
                when it is being revoked: dropping it is all that is left to do.
        """
        try:
            await work  # type: ignore[misc]
        except ProducerFenced:
            # Another enricher owns the partition now (we were too slow to notice the rebalance): drop it.
            log.warning("%s: fenced by a newer owner; letting it go", _name(part.tp))
            self._drop(part)
            await self._release(part)
        except HangingTransaction as exc:  # from _decided: nothing written yet, nothing to abort
            log.warning("%s: %s; taking it over again (it waits there)", _name(part.tp), exc)
            await self._start_over(part, take_over=take_over)
        except (KafkaError, IllegalOperation) as exc:
            # IllegalOperation: aiokafka refuses to send or add offsets outside a transaction, which is how
            # a producer whose sender task died answers (see _begin); a new producer replaces it.
            log.warning(
                "%s: transaction failed (%s); starting over from the last commit", _name(part.tp), _why(exc)
            )
            self.stats.aborted += 1
            # A new producer with the same transactional ID aborts the failed transaction for us.
            await self._start_over(part, take_over=take_over)

    async def _start_over(self, part: _Partition, *, take_over: bool) -> None:
        """Drop ``part`` and stop its producer; take it over again if asked and it is still assigned to us."""
        self._drop(part)
        await self._release(part)
        if take_over and self._consumer is not None and part.tp in self._consumer.assignment():
            self._take_over(part.tp)

    def _drop(self, part: _Partition) -> None:
        self._partitions.pop(part.tp, None)
        if self._consumer is not None and part.tp in self._consumer.assignment():
            self._consumer.pause(part.tp)


class _Batches:
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


def _dead_headers(
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


async def _start(producer: AIOKafkaProducer) -> None:
    """``producer.start()``, aiokafka's assertion that no broker is known raised as a retriable error.

    Right after a broker's restart its metadata may list no broker yet; aiokafka's coordinator lookup
    then fails ``assert node_id is not None, "Did we not perform bootstrap?"`` (seen once in CI's restart
    test: the take-over's task ended with it, and the enricher with the task). It is the same state as a
    cluster not reachable yet: the take-over tries again.
    """
    try:
        await producer.start()
    except AssertionError as exc:
        if "bootstrap" not in str(exc):
            raise
        raise KafkaConnectionError(f"the cluster's metadata lists no broker yet ({exc})") from exc


async def _begin(producer: AIOKafkaProducer) -> None:
    """``producer.begin_transaction()``, a refusal raised as a :class:`KafkaError`.

    aiokafka's sender task can die (0.12: a connection lost during a FindCoordinator lookup, as when the broker
    restarts, is not retried and ends it); the producer's transaction state is then FATAL_ERROR for good, and
    every later call fails. ``begin_transaction`` fails with the ``assert`` of aiokafka's state machine; under
    ``python -O`` it begins instead, and the first send raises the sender's error (a KafkaError). Both end the
    same way: the partition is taken over again, by a new producer.
    """
    try:
        await producer.begin_transaction()
    except AssertionError as exc:
        raise KafkaError(f"the producer cannot begin a transaction ({exc})") from exc


async def _stop_producer(producer: AIOKafkaProducer, timeout: float = _STOP_GRACE) -> None:
    """Stop ``producer``, giving up after ``timeout`` seconds (a broker that is down may never answer)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), timeout)


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least a moment: past it, a step gets just that."""
    return max(deadline - time.monotonic(), 0.1)


def _name(tp: TopicPartition) -> str:
    return f"{tp.topic}[{tp.partition}]"


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """Hands rebalances to the enricher (aiokafka awaits these before it fetches again)."""

    def __init__(self, enricher: Enricher) -> None:
        self._enricher = enricher

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self._enricher._revoked(revoked)

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self._enricher._assigned(assigned)
