"""Asking the dispensers over Kafka: the requests of ``dispenser.client.KafkaIdClient``, the client's transport.

:class:`KafkaIdRequester` is :class:`dispenser.client.KafkaIdClient` without the calls that raise the client's
errors; :class:`KafkaIdTransport` carries :class:`dispenser.client.IdClient`'s requests. One producer sends
requests with Spring's reply headers; one consumer, in no consumer group, reads the reply topic from the end
and resolves the waiting future by correlation ID. See ``docs/kafka.md``. aiokafka's exceptions end here
(:class:`OSError`, :class:`TimeoutError`), so the client above knows nothing of the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from types import TracebackType
from typing import Self

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from dispenser.adapters.kafka.connection import (
    CONTENT_TYPE,
    CORRELATION_ID,
    REPLY_PARTITION,
    REPLY_TOPIC,
    check_security,
    client_options,
    encode_partition,
    header,
    topic_partitions,
)
from dispenser.config import KafkaConfig
from dispenser.messages import MSGPACK, IdRequest, KafkaIdRequest, Kind, Reply, ReplyFormat

__all__ = ["KafkaIdRequester", "KafkaIdTransport"]

# The client's logger, as before this module moved out of dispenser.client: a user's logging settings for
# "dispenser.client" still cover the replies it reads.
log = logging.getLogger("dispenser.client.kafka")


def _undelivered(reply: asyncio.Future[Reply], delivery: asyncio.Future[object]) -> None:
    """Fail the waiting ``reply`` with OSError if the request's ``delivery`` failed (else leave it)."""
    if delivery.cancelled():
        return
    error = delivery.exception()
    if error is not None and not reply.done():
        reply.set_exception(OSError(f"could not send the request: {error}"))


_json_reply = msgspec.json.Decoder(Reply)
_msgpack_reply = msgspec.msgpack.Decoder(Reply)
_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


class KafkaIdRequester:
    """Ask the dispensers for IDs over Kafka, one reply per request; one instance serves any number at once.

    :class:`dispenser.client.KafkaIdClient` is this with :meth:`~dispenser.client.KafkaIdClient.ids` and
    :meth:`~dispenser.client.KafkaIdClient.ranges`, which raise the client's errors for error replies.

    Args:
        config: servers and credentials (``request_topic`` and ``reply_topic`` are used too).
        reply_topic: where replies should go; default ``config.reply_topic``.
        reply_partition: ask for replies on this partition only (and read only it); default: read all.
        timeout: seconds a request waits for its reply by default.
        msgpack: send msgpack instead of JSON (replies come back in the same encoding).
    """

    def __init__(
        self,
        config: KafkaConfig | None = None,
        *,
        reply_topic: str | None = None,
        reply_partition: int | None = None,
        timeout: float = 5.0,
        msgpack: bool = False,
    ) -> None:
        self._config = config or KafkaConfig()
        topic = reply_topic or self._config.reply_topic
        if not topic:
            raise ValueError("a reply topic is needed: pass reply_topic or set kafka.reply_topic")
        self.reply_topic = topic
        self.reply_partition = reply_partition
        self.timeout = timeout
        self.msgpack = msgpack
        self._pending: dict[bytes, asyncio.Future[Reply]] = {}
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, and position the reply consumer at the end of the reply topic.

        Raises:
            OSError: Kafka could not be reached, or the reply topic (or partition) does not exist.
        """
        await check_security(self._config)
        options = client_options(self._config)
        self._producer = AIOKafkaProducer(**options, acks=1, linger_ms=0)
        self._consumer = AIOKafkaConsumer(**options, enable_auto_commit=False, group_id=None)
        try:
            await self._producer.start()
            await self._consumer.start()
            partitions = await self._reply_partitions()
            if self.reply_partition is not None:
                if self.reply_partition not in partitions:
                    raise OSError(f"reply topic {self.reply_topic!r} has no partition {self.reply_partition}")
                partitions = {self.reply_partition}
            tps = [TopicPartition(self.reply_topic, p) for p in sorted(partitions)]
            self._consumer.assign(tps)
            await self._consumer.seek_to_end(*tps)
            # seek_to_end is lazy: resolve the positions now, or a reply landing before the first fetch
            # (to a requester that was quick) would be skipped.
            for tp in tps:
                await self._consumer.position(tp)
        except KafkaError as exc:
            await self.close()
            raise OSError(f"cannot reach Kafka at {self._config.bootstrap_servers}: {exc}") from exc
        except BaseException:
            await self.close()
            raise
        self._reader = asyncio.create_task(self._read_replies(), name="kafka-id-client-replies")

    async def _reply_partitions(self, wait: float = 5.0) -> set[int]:
        """The reply topic's partitions; a topic created a moment ago may take a few metadata rounds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            try:
                return set(range(await topic_partitions(self._config, self.reply_topic)))
            except OSError:
                if loop.time() > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        """Stop reading replies and close the connections; waiting requests fail with ``ConnectionError``."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the client was closed"))
        self._pending.clear()
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._consumer = self._producer = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def request(
        self,
        tag: str,
        count: int = 1,
        *,
        kind: Kind = "segment",
        format: ReplyFormat = "ids",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """Send one request and return its reply, error replies included.

        Raises:
            TimeoutError: no reply within ``timeout`` seconds (the request may still be answered later;
                retry with the same ``request_id`` to get the same IDs).
            OSError: the request could not be sent, or the broker did not acknowledge it within
                ``kafka.request_timeout_ms`` (raised then, before ``timeout``; it may still have been
                written: retry with the same ``request_id`` to get the same IDs).
        """
        if self._producer is None:
            raise RuntimeError(f"{type(self).__name__} is not started (use `async with` or await start())")
        request = KafkaIdRequest(tag=tag, kind=kind, count=count, format=format, request_id=request_id)
        body = (_msgpack if self.msgpack else _json).encode(request)
        correlation = uuid.uuid4().bytes
        headers = [(REPLY_TOPIC, self.reply_topic.encode()), (CORRELATION_ID, correlation)]
        if self.reply_partition is not None:
            headers.append((REPLY_PARTITION, encode_partition(self.reply_partition)))
        if self.msgpack:
            headers.append((CONTENT_TYPE, MSGPACK.encode()))
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = future
        try:
            try:
                delivery = await self._producer.send(
                    self._config.request_topic, body, key=tag.encode(), headers=headers
                )
            except KafkaError as exc:
                raise OSError(f"could not send the request: {exc}") from exc
            # Not awaited: the reply may come before the acknowledgement (acks=all waits for every replica).
            # But a delivery that fails (the broker leading the request topic hung, past request_timeout_ms)
            # fails the request at once rather than at its timeout, and its error is retrieved, not logged
            # as "never retrieved" when the future is collected.
            delivery.add_done_callback(functools.partial(_undelivered, future))
            return await asyncio.wait_for(future, self.timeout if timeout is None else timeout)
        finally:
            self._pending.pop(correlation, None)

    async def _read_replies(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                fetched = await self._consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                log.warning("reading replies: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for records in fetched.values():
                for record in records:
                    correlation = header(record.headers, CORRELATION_ID)
                    future = self._pending.get(correlation) if correlation is not None else None
                    if future is None or future.done():
                        continue  # another client's reply, or a second answer to a re-delivered request
                    msgpack = header(record.headers, CONTENT_TYPE) == MSGPACK.encode()
                    try:
                        reply = (_msgpack_reply if msgpack else _json_reply).decode(record.value or b"")
                    except msgspec.DecodeError as exc:
                        future.set_exception(OSError(f"undecodable reply: {exc}"))
                    else:
                        future.set_result(reply)


class KafkaIdTransport:
    """ID requests over Kafka through a :class:`KafkaIdRequester`, for :class:`dispenser.client.IdClient`.

    Args:
        config: servers and credentials; the other arguments are :class:`KafkaIdRequester`'s.
    """

    def __init__(
        self,
        config: KafkaConfig | None = None,
        *,
        reply_topic: str | None = None,
        reply_partition: int | None = None,
    ) -> None:
        self.client = KafkaIdRequester(config, reply_topic=reply_topic, reply_partition=reply_partition)
        """The requester the requests go through."""

    async def start(self) -> None:
        """Connect (see :meth:`KafkaIdRequester.start`)."""
        await self.client.start()

    async def close(self) -> None:
        """Disconnect."""
        await self.client.close()

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Send one ID request and return its reply (error replies included).

        Raises:
            TimeoutError: no reply in time.
            OSError: the request could not be sent.
        """
        return await self.client.request(
            tag,
            request.count,
            kind=kind,
            format=request.format,
            request_id=request.request_id,
            timeout=timeout,
        )
