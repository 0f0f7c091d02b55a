"""ID requests over Kafka: consume the request topic in a consumer group, produce each reply to its reply topic.

A request record is keyed by tag (:class:`~dispenser.messages.KafkaIdRequest`); the reply follows Spring's
``kafka_replyTopic``, ``kafka_replyPartition`` and ``kafka_correlationId`` headers. Delivery is at least
once, and one client's bad reply address never holds up the others: ``docs/kafka.md``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from dispenser.adapters.kafka.connection import (
    CONTENT_TYPE,
    CORRELATION_ID,
    REPLY_PARTITION,
    REPLY_TOPIC,
    client_options,
    decode_partition,
    ensure_topics,
    header,
)
from dispenser.adapters.kafka.headers import ERROR_CODE_HEADER
from dispenser.config import KafkaConfig
from dispenser.core.errors import DispenserError, KindNotServed, MessageTooLarge
from dispenser.messages import MSGPACK, decode_kafka_request
from dispenser.service.answering import Answer, Answerer
from dispenser.service.retry import Backoff

__all__ = ["KafkaRequestService", "RequestStats"]

log = logging.getLogger(__name__)

_MSGPACK = MSGPACK.encode()


@dataclass
class RequestStats:
    """Counters of what the service did, for tests, logs and (later) metrics."""

    requests: int = 0
    replies: int = 0
    errors: int = 0
    no_reply_topic: int = 0
    """Requests dropped because they named no reply topic and none is configured."""
    undeliverable: int = 0
    """Replies that could not be produced (a missing topic or partition, or the request expired)."""
    expired: int = 0
    """Requests older than ``request_max_age`` when they arrived: skipped, their requester has given up."""
    by_code: dict[str, int] = field(default_factory=dict)


_LOG_EVERY = 60.0
"""Seconds between two log lines about undeliverable replies to the same topic (the rest are counted)."""


@dataclass(slots=True)
class _Reply:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    received: float


class _Batch:
    """One ``getmany`` result: the offsets to commit once every reply in it is acknowledged."""

    __slots__ = ("done", "offsets", "pending")

    def __init__(self, offsets: dict[TopicPartition, int]) -> None:
        self.offsets = offsets
        # Delivery futures of replies produced inline (with the reply, to send again should one fail),
        # and tasks of requests that had to wait (they deliver their own reply).
        self.pending: list[tuple[asyncio.Future[object], _Reply | None]] = []
        self.done = False


class KafkaRequestService:
    """Answers ID requests from a Kafka topic, sharing its partitions with the other workers of the group."""

    def __init__(
        self,
        config: KafkaConfig,
        dispatchers: Mapping[str, Answerer],
        *,
        max_body_bytes: int = 4096,
        request_max_age: float = 60.0,
        commit_interval: float = 0.2,
        reply_timeout: float = 1.0,
    ) -> None:
        """Prepare the service.

        Args:
            config: servers, credentials, topics and group.
            dispatchers: by generator kind (``segment``, ``snowflake``), as for NATS.
            max_body_bytes: larger request bodies get a ``too_large`` error reply.
            request_max_age: seconds after which a request (or its undelivered reply) is given up.
            commit_interval: seconds between offset commits.
            reply_timeout: seconds a reply may wait for its topic's metadata (a topic that does not exist)
                before it is given up as undeliverable.
        """
        self._config = config
        self._dispatchers = dispatchers
        self._max_body = max_body_bytes
        self._max_age = request_max_age
        self._commit_interval = commit_interval
        self._reply_timeout = reply_timeout
        self._lookups: dict[str, asyncio.Future[bool]] = {}
        """Topic metadata lookups under way, shared by the replies waiting for them."""
        self._unlogged: dict[str, tuple[float, int]] = {}
        """By topic: when an undeliverable reply to it was last logged, and how many were not logged since."""
        self.stats = RequestStats()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._batches: collections.deque[_Batch] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._completions: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Create missing topics (if configured), join the group and start answering.

        Raises:
            OSError: Kafka could not be reached.
        """
        config = self._config
        if config.create_topics:
            topics = {config.request_topic: config.topic_partitions}
            if config.reply_topic:
                topics[config.reply_topic] = config.topic_partitions
            await ensure_topics(config, topics)
        options = client_options(config)
        self._producer = AIOKafkaProducer(**options, acks=1, linger_ms=0)
        self._consumer = AIOKafkaConsumer(
            config.request_topic,
            **options,
            group_id=config.group_id,
            enable_auto_commit=False,
            # A new group answers what is already waiting (requests older than request_max_age are skipped).
            auto_offset_reset="earliest",
            session_timeout_ms=config.session_timeout_ms,
            heartbeat_interval_ms=config.heartbeat_interval_ms,
        )
        try:
            await self._producer.start()
            await self._consumer.start()
        except KafkaError as exc:
            await self._close_clients()
            raise OSError(f"cannot reach Kafka at {config.bootstrap_servers}: {exc}") from exc
        self._tasks = [
            asyncio.create_task(self._consume(), name="kafka-requests"),
            asyncio.create_task(self._commit_loop(), name="kafka-request-commits"),
        ]
        log.info("serving ID requests from Kafka topic %r in group %r", config.request_topic, config.group_id)

    def assignment(self) -> set[TopicPartition]:
        """The request-topic partitions this worker answers now (empty until the group has settled)."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    def alive(self) -> bool:
        """Whether the service is consuming (false after :meth:`stop`, or if its loop died)."""
        return bool(self._tasks) and not any(task.done() for task in self._tasks)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop consuming, deliver the replies under way (up to ``grace`` seconds), commit, leave the group."""
        self._stopping.set()
        if self._tasks:
            consume, committer = self._tasks
            consume.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consume
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain(), grace)
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer
            with contextlib.suppress(KafkaError, TimeoutError):
                await asyncio.wait_for(self._commit_done(), grace)
            self._tasks = []
        await self._close_clients()

    async def _drain(self) -> None:
        while self._completions:
            await asyncio.gather(*self._completions, return_exceptions=True)

    async def _close_clients(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()

    async def _consume(self) -> None:
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("KafkaRequestService used before start()")
        backoff = Backoff(0.5, 0.5, stop=self._stopping)
        while True:
            try:
                fetched = await consumer.getmany(timeout_ms=500, max_records=500)
            except KafkaError as exc:  # the consumer reconnects by itself; don't spin while it does
                log.warning("Kafka request consumer: %s", exc)
                await backoff.wait()
                continue
            if not fetched:
                continue
            batch = _Batch({tp: records[-1].offset + 1 for tp, records in fetched.items()})
            for records in fetched.values():
                for record in records:
                    try:
                        await self._handle(record, batch)
                    except Exception:  # a bug: log it, and keep serving the other requests
                        log.exception(
                            "could not answer the request at %s[%d]@%d",
                            record.topic,
                            record.partition,
                            record.offset,
                        )
            self._batches.append(batch)
            if batch.pending:
                self._completions.add(task := asyncio.create_task(self._complete(batch)))
                task.add_done_callback(self._completions.discard)
            else:
                batch.done = True

    async def _complete(self, batch: _Batch) -> None:
        """Wait until every reply of ``batch`` is delivered (sending again what failed), then mark it done."""
        for future, reply in batch.pending:
            try:
                await future
            except Exception as exc:
                if reply is None:  # a waiting request's task: it delivers (or gives up) by itself
                    log.exception("answering a request failed", exc_info=exc)
                else:
                    await self._deliver(reply)
        batch.done = True

    async def _handle(self, record: ConsumerRecord[bytes, bytes], batch: _Batch) -> None:
        """Answer one request: inline when IDs are at hand, in a task of its own when it must wait."""
        stats = self.stats
        stats.requests += 1
        received = time.monotonic()
        headers = list(record.headers)
        if (
            self._max_age
            and record.timestamp
            and time.time() * 1000 - record.timestamp > self._max_age * 1000
        ):
            stats.expired += 1
            return
        topic_raw = header(headers, REPLY_TOPIC)
        reply_topic = topic_raw.decode("utf-8", "replace") if topic_raw else self._config.reply_topic
        if not reply_topic:
            stats.no_reply_topic += 1
            log.warning(
                "dropping a request at %s[%d]@%d: no %s header and no kafka.reply_topic configured",
                record.topic,
                record.partition,
                record.offset,
                REPLY_TOPIC,
            )
            return
        partition_raw = header(headers, REPLY_PARTITION)
        partition = decode_partition(partition_raw) if partition_raw is not None else None
        msgpack = header(headers, CONTENT_TYPE) == _MSGPACK
        reply_headers = []
        correlation = header(headers, CORRELATION_ID)
        if correlation is not None:
            reply_headers.append((CORRELATION_ID, correlation))
        if msgpack:
            reply_headers.append((CONTENT_TYPE, _MSGPACK))
        reply = _Reply(reply_topic, partition, record.key, b"", reply_headers, received)
        key_tag = record.key.decode("utf-8", "replace") if record.key else ""
        body = record.value or b""
        dispatcher = next(iter(self._dispatchers.values()))
        try:
            if len(body) > self._max_body:
                raise MessageTooLarge(len(body), self._max_body)
            # Decoded once, here: the kind picks the dispatcher. A KafkaIdRequest is an IdRequest, which
            # the dispatcher answers as it is (it checks the tag and the count itself).
            request = decode_kafka_request(body, msgpack)
            chosen = self._dispatchers.get(request.kind)
            if chosen is None:
                raise KindNotServed(request.kind, list(self._dispatchers))
            dispatcher = chosen
        except DispenserError as exc:
            await self._send(reply, dispatcher.error(key_tag, exc, msgpack), batch)
            return
        tag = request.tag if request.tag is not None else key_tag
        answer = dispatcher.answer_now(tag, request, msgpack)
        if answer is not None:
            await self._send(reply, answer, batch)
            return

        async def later() -> None:
            await self._send(reply, await dispatcher.answer(tag, request, msgpack), None)

        batch.pending.append((asyncio.create_task(later()), None))

    async def _send(self, reply: _Reply, answer: Answer, batch: _Batch | None) -> None:
        """Produce the reply; its delivery is awaited before the batch's offsets are committed.

        Inline (``batch`` given) the reply is only queued in the producer, and :meth:`_complete` awaits its
        delivery with the rest of the batch: no task per reply on the common path.
        """
        self._count(answer)
        reply.value = answer.body
        if answer.error is not None:
            reply.headers.append((ERROR_CODE_HEADER, answer.error.code.encode()))
        if batch is None:
            await self._deliver(reply)
            return
        partitions = self._partitions(reply.topic)
        if partitions is None:
            # send() would wait here for the topic's metadata, up to request_timeout_ms (5 s by default) for
            # a topic that does not exist, and every request behind this one with it: wait in a task instead.
            batch.pending.append((asyncio.create_task(self._deliver(reply)), None))
            return
        if reply.partition is not None and reply.partition not in partitions:
            self._undeliverable(reply, f"it has no partition {reply.partition}")
            return
        assert self._producer is not None
        try:
            future = await self._producer.send(
                reply.topic, reply.value, key=reply.key, partition=reply.partition, headers=reply.headers
            )
        except KafkaError:  # not even queued: the slow path retries (or gives up) and says why
            batch.pending.append((asyncio.create_task(self._deliver(reply)), None))
            return
        batch.pending.append((future, reply))

    def _count(self, answer: Answer) -> None:
        stats = self.stats
        stats.replies += 1
        if answer.error is not None:
            stats.errors += 1
            stats.by_code[answer.error.code] = stats.by_code.get(answer.error.code, 0) + 1

    async def _deliver(self, reply: _Reply) -> None:
        """Send until the broker acknowledges, the request expires, or the reply can never be delivered."""
        producer = self._producer
        if producer is None:
            raise RuntimeError("KafkaRequestService used before start()")
        backoff = Backoff(0.1, 2.0)  # the task ends with the request's age, or is cancelled on stop
        while True:
            partitions = self._partitions(reply.topic)
            if partitions is None and await self._look_up(reply.topic):
                partitions = self._partitions(reply.topic)
            if partitions is None:
                self._undeliverable(reply, f"no such topic (unknown after {self._reply_timeout:g} s)")
                return
            if reply.partition is not None and reply.partition not in partitions:
                self._undeliverable(reply, f"it has no partition {reply.partition}")
                return
            try:
                delivery = await producer.send(
                    reply.topic, reply.value, key=reply.key, partition=reply.partition, headers=reply.headers
                )
                await delivery
            except KafkaError as exc:
                if not (exc.retriable or isinstance(exc, KafkaTimeoutError)):
                    self._undeliverable(reply, str(exc) or type(exc).__name__)
                    return
                if self._max_age and time.monotonic() - reply.received > self._max_age:
                    self._undeliverable(reply, f"still failing after {self._max_age:g} s: {exc}")
                    return
                log.warning("reply to %s not delivered yet (%s); retrying", reply.topic, exc)
                await backoff.wait()
            else:
                return

    def _partitions(self, topic: str) -> set[int] | None:
        """``topic``'s partitions if the producer has its metadata (then send() waits for none), else None.

        An explicit reply partition is checked against these rather than left to aiokafka's ``assert``
        (which ``python -O`` removes).
        """
        assert self._producer is not None
        partitions: set[int] | None = self._producer.client.cluster.partitions_for_topic(topic)
        return partitions

    async def _look_up(self, topic: str) -> bool:
        """Whether ``topic``'s metadata arrives within ``reply_timeout`` (one lookup per topic at a time)."""
        lookup = self._lookups.get(topic)
        if lookup is None:
            lookup = self._lookups[topic] = asyncio.ensure_future(self._wait_for_metadata(topic))
            lookup.add_done_callback(lambda _done: self._lookups.pop(topic, None))
        # Shielded: a cancelled reply task must not cancel the lookup the others share.
        return await asyncio.shield(lookup)

    async def _wait_for_metadata(self, topic: str) -> bool:
        assert self._producer is not None
        try:
            async with asyncio.timeout(self._reply_timeout):
                await self._producer.partitions_for(topic)
        except (TimeoutError, KafkaError):
            return False
        return True

    def _undeliverable(self, reply: _Reply, why: str) -> None:
        self.stats.undeliverable += 1
        now = time.monotonic()
        logged, since = self._unlogged.get(reply.topic, (-_LOG_EVERY, 0))
        if now - logged < _LOG_EVERY:
            self._unlogged[reply.topic] = (logged, since + 1)
            return
        if len(self._unlogged) >= 1024:  # many bad names: forget those not logged lately
            self._unlogged = {t: e for t, e in self._unlogged.items() if now - e[0] < _LOG_EVERY}
        self._unlogged[reply.topic] = (now, 0)
        more = f" ({since} more since the last report)" if since else ""
        log.warning("cannot deliver a reply to topic %r: %s; reply dropped%s", reply.topic, why, more)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self._commit_interval)
            try:
                await self._commit_done()
            except KafkaError as exc:  # e.g. a rebalance: those records are answered again, no harm
                log.info("offset commit failed (will retry): %s", exc)

    async def _commit_done(self) -> None:
        """Commit the offsets of the leading batches whose replies are all acknowledged."""
        assert self._consumer is not None
        offsets: dict[TopicPartition, int] = {}
        while self._batches and self._batches[0].done:
            offsets.update(self._batches.popleft().offsets)
        if not offsets:
            return
        assigned = self._consumer.assignment()
        offsets = {tp: offset for tp, offset in offsets.items() if tp in assigned}
        if offsets:
            await self._consumer.commit(offsets)
