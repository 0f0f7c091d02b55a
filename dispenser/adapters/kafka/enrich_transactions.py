"""The transactions of ``dispenser enrich``: owning input partitions, each with its transactional producer.

Taking a partition over (fencing its previous owner, waiting for its transactions to be decided, reading
its offset strictly), committing, starting a partition over after a Kafka failure, and winding down.
:class:`PartitionOwner` is the base of :class:`~dispenser.adapters.kafka.enrich.Enricher`, which adds the
record processing. Why it holds: ``docs/kafka.md`` ("Stream enrichment").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import IllegalOperation, KafkaConnectionError, KafkaError, ProducerFenced

from dispenser.adapters.kafka.connection import client_options
from dispenser.adapters.kafka.enrich_settings import EnrichSettings, EnrichStats
from dispenser.adapters.kafka.offsets import CommittedOffsets, HangingTransaction
from dispenser.config import KafkaConfig
from dispenser.service.retry import Backoff, Stopped

__all__ = [
    "RETRY_MAX",
    "STOP_GRACE",
    "OwnedPartition",
    "PartitionOwner",
    "begin_transaction",
    "describe_error",
    "partition_name",
    "seconds_left",
    "start_producer",
    "stop_producer",
]

log = logging.getLogger("dispenser.adapters.kafka.enrich")  # the enricher's log lines, wherever written

RETRY_MAX = 5.0
"""The longest pause, in seconds, between two attempts to take IDs or to take a partition over."""
STOP_GRACE = 3.0
"""Seconds a stop gives winding down (commit or abort, closing the producers, leaving the group) before it
gives up on each further step: a broker that is down must not keep the process alive."""
_DECIDED_WAIT = 2.0
"""Seconds a partition's next transaction waits for its last one's markers (ms, usually) before the partition is
taken over again, which waits on without holding up the others (see :meth:`PartitionOwner._decided`)."""
_DECIDED_POLL = 0.005


class OwnedPartition:
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
        (:meth:`PartitionOwner._decided`)."""


class PartitionOwner:
    """The input partitions an enricher owns, each in Kafka transactions of its own transactional producer."""

    def __init__(self, kafka: KafkaConfig, settings: EnrichSettings) -> None:
        self._kafka = kafka
        self.settings = settings
        self.stats = EnrichStats()
        self._consumer: AIOKafkaConsumer | None = None
        self._offsets = CommittedOffsets(kafka, settings.group)
        self._partitions: dict[TopicPartition, OwnedPartition] = {}
        self._taking: dict[TopicPartition, asyncio.Task[None]] = {}
        """Take-overs under way (the partition paused meanwhile): see :meth:`_take_over`."""
        self._failure: BaseException | None = None
        """What ended a take-over unexpectedly (a bug, not Kafka): the enricher's ``run`` raises it."""
        self._lock = asyncio.Lock()
        self._out_partitions = 1
        self._dlq_partitions = 1
        self._stop = asyncio.Event()
        """Set by the enricher's ``run`` caller: the retry loops (IDs, taking over a partition) end at once."""

    async def _wind_down(self, part: OwnedPartition, commit: bool, deadline: float) -> None:
        """End ``part``'s open transaction (committed if asked and possible in time, else aborted); stop its producer.

        Never raises: a producer whose commit was cancelled half-way may refuse even to abort (aiokafka
        then raises whatever its state machine says); the broker aborts for it, as after a crash.
        """
        name = partition_name(part.tp)
        if part.in_transaction and commit and not part.half_done:
            try:
                await asyncio.wait_for(self._commit(part), seconds_left(deadline))
            except Exception as exc:  # any failure: abort instead
                log.warning("%s: could not commit on stop (%s); aborting", name, describe_error(exc))
        if part.in_transaction:
            try:
                await asyncio.wait_for(part.producer.abort_transaction(), seconds_left(deadline))
            except Exception as exc:  # any failure: the broker aborts it
                log.warning("%s: could not abort on stop (%s); the broker will", name, describe_error(exc))
            else:
                self.stats.aborted += 1
                log.info("%s: aborted the open transaction (%d records)", name, part.pending)
            part.in_transaction = False
        await stop_producer(part.producer, seconds_left(deadline))

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
        task = asyncio.create_task(self._own(tp), name=f"take over {partition_name(tp)}")
        self._taking[tp] = task
        task.add_done_callback(functools.partial(self._took_over, tp))

    def _took_over(self, tp: TopicPartition, task: asyncio.Task[None]) -> None:
        if self._taking.get(tp) is task:
            del self._taking[tp]
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, Stopped) and self._failure is None:
            log.error("taking over %s failed", partition_name(tp), exc_info=error)
            self._failure = error

    async def _own(self, tp: TopicPartition) -> None:
        """Take over ``tp``: fence its previous owner, then resume after its last committed transaction."""
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("taking over a partition before start()")
        backoff = Backoff(0.2, RETRY_MAX, stop=self._stop)
        while True:
            # A new producer for each attempt: once stopped, an AIOKafkaProducer started again could never be
            # stopped (its stop() is a no-op after the first), leaking its connections and sender task.
            producer = self._producer(tp)
            try:
                # start() runs InitProducerId: the broker aborts the previous owner's open transaction
                # and bumps the epoch, so the previous owner can no longer commit.
                await backoff.attempt(start_producer(producer))
                # The previous owner's last transaction may still be pending (acknowledged, its markers not
                # all written: seen for seconds after a broker kill -9) although the fence is up: wait
                # until every transaction on our output partitions is decided before reading the offset.
                waited = await self._settled(tp, backoff)
                if waited > 1.0:
                    log.info(
                        "%s: waited %.1f s for open transactions to be decided", partition_name(tp), waited
                    )
                # Not consumer.committed(): it answers None ("never committed") while the coordinator is
                # still loading after a broker restart, and the partition would start over (see offsets.py).
                committed = await backoff.attempt(self._offsets.committed(tp))
                break
            except KafkaError as exc:
                await stop_producer(producer)
                log.warning("cannot take over %s yet: %s", partition_name(tp), exc)
                try:
                    await backoff.wait()
                except Stopped:
                    log.info("stopping: leaving %s to its next owner", partition_name(tp))
                    raise
            except BaseException:  # stopping (Stopped, cancelled) half-way through a start
                await stop_producer(producer)
                raise
        try:
            async with self._lock:
                if self._stop.is_set() or tp not in consumer.assignment():
                    await stop_producer(producer)  # revoked (or closing) meanwhile: not ours to enrich
                    return
                if committed is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, committed)
                part = OwnedPartition(tp, producer, self._outputs_of(tp))
                # Records fetched before this take-over (a stale getmany result) are below this and skipped.
                part.next_offset = 0 if committed is None else committed
                self._partitions[tp] = part
                consumer.resume(tp)
        except BaseException:  # cancelled (closing) before the partition was ours
            if self._partitions.get(tp) is None:
                await stop_producer(producer)
            raise
        log.info(
            "enriching %s from offset %s",
            partition_name(tp),
            "the beginning" if committed is None else committed,
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
            # Batches are built here (see enrich_records.Batches); one may hold the largest record allowed.
            max_batch_size=max(262_144, self.settings.max_record_bytes + 65_536),
            max_request_size=max(1_048_576, self.settings.max_record_bytes + 65_536),
        )

    async def _release(self, part: OwnedPartition) -> None:
        await stop_producer(part.producer)

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

    async def _commit(self, part: OwnedPartition) -> None:
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

    async def _decided(self, part: OwnedPartition) -> None:
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
                    f"the last transaction of {partition_name(part.tp)} is still undecided on"
                    f" {', '.join(partition_name(where) for where in sorted(part.unsure))} after {_DECIDED_WAIT:g} s"
                )
            await asyncio.sleep(_DECIDED_POLL)

    def _count_committed(self, part: OwnedPartition) -> None:
        stats = self.stats
        stats.transactions += 1
        stats.dead_lettered += part.dead
        stats.enriched += part.pending - part.dead

    async def _guarded(self, part: OwnedPartition, work: object, *, take_over: bool = True) -> None:
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
            log.warning("%s: fenced by a newer owner; letting it go", partition_name(part.tp))
            self._drop(part)
            await self._release(part)
        except HangingTransaction as exc:  # from _decided: nothing written yet, nothing to abort
            log.warning("%s: %s; taking it over again (it waits there)", partition_name(part.tp), exc)
            await self._start_over(part, take_over=take_over)
        except (KafkaError, IllegalOperation) as exc:
            # IllegalOperation: aiokafka refuses to send or add offsets outside a transaction, which is how
            # a producer whose sender task died answers (see begin_transaction); a new producer replaces it.
            log.warning(
                "%s: transaction failed (%s); starting over from the last commit",
                partition_name(part.tp),
                describe_error(exc),
            )
            self.stats.aborted += 1
            # A new producer with the same transactional ID aborts the failed transaction for us.
            await self._start_over(part, take_over=take_over)

    async def _start_over(self, part: OwnedPartition, *, take_over: bool) -> None:
        """Drop ``part`` and stop its producer; take it over again if asked and it is still assigned to us."""
        self._drop(part)
        await self._release(part)
        if take_over and self._consumer is not None and part.tp in self._consumer.assignment():
            self._take_over(part.tp)

    def _drop(self, part: OwnedPartition) -> None:
        self._partitions.pop(part.tp, None)
        if self._consumer is not None and part.tp in self._consumer.assignment():
            self._consumer.pause(part.tp)


async def start_producer(producer: AIOKafkaProducer) -> None:
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


async def begin_transaction(producer: AIOKafkaProducer) -> None:
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


async def stop_producer(producer: AIOKafkaProducer, timeout: float = STOP_GRACE) -> None:
    """Stop ``producer``, giving up after ``timeout`` seconds (a broker that is down may never answer)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), timeout)


def describe_error(exc: BaseException) -> str:
    """How ``exc`` reads in a log line: its message, else its class's name."""
    return str(exc) or type(exc).__name__


def seconds_left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least a moment: past it, a step gets just that."""
    return max(deadline - time.monotonic(), 0.1)


def partition_name(tp: TopicPartition) -> str:
    """``topic[partition]``, as the log lines name a partition."""
    return f"{tp.topic}[{tp.partition}]"
