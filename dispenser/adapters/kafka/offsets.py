"""A consumer group's committed offsets, read so that "unknown" is never mistaken for "never committed".

:class:`CommittedOffsets` sends OffsetFetch v7 with ``require_stable`` itself (aiokafka's ``committed()``
reads a coordinator still loading as "none", and sends no ``require_stable``) and accepts only an
error-free answer that names the partition; anything else raises, so the caller retries. Why, and what
was measured: ``docs/kafka.md`` ("What exactly once means here, and why it holds").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from aiokafka import AIOKafkaClient, TopicPartition
from aiokafka.client import CoordinationType
from aiokafka.errors import (
    GroupCoordinatorNotAvailableError,
    KafkaError,
    LeaderNotAvailableError,
    NoError,
    for_code,
)
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)

from dispenser.adapters.kafka.connection import client_options
from dispenser.config import KafkaConfig

__all__ = ["CommittedOffsets", "HangingTransaction", "UnknownCommittedOffset", "UnstableOffsetCommit"]

log = logging.getLogger(__name__)

_NO_OFFSET = -1
_LATEST = -1
"""ListOffsets' timestamp for "the end of the partition"."""
_READ_UNCOMMITTED, _READ_COMMITTED = 0, 1
_SETTLE_POLL = 0.05
_SETTLE_WARN = 5.0
"""Seconds of waiting for open transactions to be decided before a warning says what is waited for."""


class UnknownCommittedOffset(GroupCoordinatorNotAvailableError):  # type: ignore[misc]  # aiokafka is untyped
    """The coordinator answered without the partition: its committed offset is unknown (retriable)."""


class UnstableOffsetCommit(KafkaError):  # type: ignore[misc]  # aiokafka is untyped
    """A transaction that commits an offset for the partition is still pending (retriable: wait for it)."""

    errno = 88
    message = "UNSTABLE_OFFSET_COMMIT"
    retriable = True


class HangingTransaction(KafkaError):  # type: ignore[misc]  # aiokafka is untyped
    """A transaction on a partition was still undecided past the wait's timeout (retriable: wait on).

    Nothing may be written to the partition meanwhile by the producer whose transaction it may be: Kafka
    ends whatever that producer ID has open on the partition with the next marker it writes there, so an
    abort of the next transaction would drop the hanging one's records, committed or not, and a commit
    would publish them, aborted or not.
    """

    retriable = True


_ERRORS: dict[int, type[KafkaError]] = {UnstableOffsetCommit.errno: UnstableOffsetCommit}
"""Codes aiokafka does not know (it would say UnknownError)."""


class _OffsetFetchResponseV7(Response):  # type: ignore[misc]
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("topic", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition", Int32),
                        ("offset", Int64),
                        ("leader_epoch", Int32),
                        ("metadata", CompactString("utf-8")),
                        ("error_code", Int16),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class _OffsetFetchRequestV7(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = _OffsetFetchResponseV7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("topic", CompactString("utf-8")),
                ("partitions", CompactArray(Int32)),
                ("tags", TaggedFields),
            ),
        ),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class _StableOffsetFetch(Request[_OffsetFetchRequestV7]):  # type: ignore[misc]
    """OffsetFetch v7 for one partition, with ``require_stable`` (Kafka 2.5 and later)."""

    API_KEY = 9

    def __init__(self, group: str, tp: TopicPartition) -> None:
        self._group = group
        self._tp = tp

    def build(self, request_struct_class: type[_OffsetFetchRequestV7]) -> _OffsetFetchRequestV7:
        return request_struct_class(self._group, [(self._tp.topic, [self._tp.partition], {})], True, {})


class CommittedOffsets:
    """Reads the committed offsets of one consumer group from its coordinator, strictly.

    Args:
        config: How to reach the cluster (servers, security, timeouts).
        group: The consumer group.
    """

    def __init__(self, config: KafkaConfig, group: str) -> None:
        self._client = AIOKafkaClient(**client_options(config))
        self.group = group
        self._started = False

    async def start(self) -> None:
        """Connect (fetch the cluster's metadata).

        Raises:
            KafkaError: The cluster could not be reached.
        """
        await self._client.bootstrap()
        self._started = True

    async def close(self) -> None:
        """Disconnect."""
        await self._client.close()

    async def committed(self, tp: TopicPartition) -> int | None:
        """The offset committed for ``tp``: where its next consumer starts; ``None`` if never committed.

        One round trip to the coordinator (found first); no retries here.

        Raises:
            KafkaError: The coordinator could not be found or reached, or answered with an error, at the top
                level (e.g. still loading after a restart) or for the partition, or without the partition.
                Most are retriable: the caller tries again rather than taking any offset as "none".
        """
        if not self._started:
            await self.start()
        node = await self._client.coordinator_lookup(CoordinationType.GROUP, self.group)
        response = await self._client.send(node, _StableOffsetFetch(self.group, tp))
        # The group-level error (e.g. still loading), which aiokafka's own readers ignore.
        _raise_for(response.error_code, f"group {self.group!r}")
        for topic, partitions, _tags in response.topics:
            for partition, offset, _epoch, _metadata, error_code, _ptags in partitions:
                if (topic, partition) == (tp.topic, tp.partition):
                    _raise_for(error_code, f"{tp.topic}[{tp.partition}] of group {self.group!r}")
                    return None if offset == _NO_OFFSET else int(offset)
        raise UnknownCommittedOffset(f"the coordinator's answer for group {self.group!r} lacks {tp}")

    async def end(self, tp: TopicPartition, *, stable: bool) -> int:
        """The end of ``tp`` now: its high watermark, or (``stable``) its last stable offset.

        Below the last stable offset every record is decided (its transaction committed or aborted); it
        stays behind the high watermark while a transaction that wrote to ``tp`` is open or pending.

        Raises:
            KafkaError: The partition's leader is unknown or did not answer (retriable).
        """
        if not self._started:
            await self.start()
        leader = self._client.cluster.leader_for_partition(tp)
        if leader is None or leader < 0:
            await self._client.add_topic(tp.topic)
            leader = self._client.cluster.leader_for_partition(tp)
        if leader is None or leader < 0:
            # Ask the cluster again: add_topic asks only the first time a topic is named, so a leader unknown
            # then (named by another take-over at the same moment, or learnt while a restarted broker had no
            # leaders yet) stayed unknown until aiokafka's own refresh, 5 minutes later. Every take-over
            # waited that long (under the lock, before; a partition each, now).
            await self._client.force_metadata_update()
            leader = self._client.cluster.leader_for_partition(tp)
            if leader is None or leader < 0:
                raise LeaderNotAvailableError(f"no leader known for {tp.topic}[{tp.partition}]")
        isolation = _READ_COMMITTED if stable else _READ_UNCOMMITTED
        request = OffsetRequest(-1, isolation, [(tp.topic, [(tp.partition, _LATEST)])])
        response = await self._client.send(leader, request)
        for topic, partitions in response.topics:
            for partition, error_code, *rest in partitions:
                if (topic, partition) == (tp.topic, tp.partition):
                    if error_code:  # e.g. the leader moved: learn the new one before the next attempt
                        self._client.force_metadata_update()
                    _raise_for(error_code, f"the end of {tp.topic}[{tp.partition}]")
                    return int(rest[-1])
        raise LeaderNotAvailableError(f"the leader's answer lacks {tp.topic}[{tp.partition}]")

    async def settled(self, tps: Sequence[TopicPartition], timeout: float) -> float:
        """Wait until every transaction that has written to ``tps`` so far is decided; the seconds waited.

        Reads each partition's high watermark once, then waits until its last stable offset reaches it.
        After a take-over this is the barrier that makes the previous owner's last transaction final,
        committed or aborted, before its committed offset is read (see the module's notes).

        A transaction still open after ``timeout`` seconds (give it the transaction timeout: the
        coordinator aborts any transaction it knows of by then) is one the coordinator has lost, a
        "hanging" transaction (its markers dropped at a broker restart: ``docs/kafka.md``). It blocks every
        ``read_committed`` reader of the partition until an operator aborts it (``kafka-transactions.sh
        find-hanging``, then ``abort``). The wait then ends with an error line that says so and
        :class:`HangingTransaction`: the caller must not write to the partition (see that class) and
        should wait on, for the operator (or the test kit's repair) to decide the transaction.

        Raises:
            HangingTransaction: A transaction was still undecided after ``timeout`` seconds (retriable).
            KafkaError: An end could not be read (retriable).
        """
        began = time.monotonic()
        marks = {tp: await self.end(tp, stable=False) for tp in dict.fromkeys(tps)}
        warned = False
        for tp, mark in marks.items():
            while (stable := await self.end(tp, stable=True)) < mark:
                waited = time.monotonic() - began
                if waited > timeout:
                    log.error(
                        "%s[%d]: a transaction open since offset %d was not decided in %.0f s (the transaction"
                        " timeout): a hanging transaction, which keeps read_committed readers of the"
                        " partition from reading past it; abort it with kafka-transactions.sh"
                        " (find-hanging, abort). Nothing is written there until it is decided.",
                        tp.topic,
                        tp.partition,
                        stable,
                        waited,
                    )
                    raise HangingTransaction(
                        f"{tp.topic}[{tp.partition}]: a transaction open since offset {stable} is undecided"
                        f" after {waited:.0f} s (a hanging transaction)"
                    )
                if not warned and waited > _SETTLE_WARN:
                    warned = True
                    log.warning(
                        "%s[%d] has a transaction open for %.0f s; waiting for it to be decided",
                        tp.topic,
                        tp.partition,
                        waited,
                    )
                await asyncio.sleep(_SETTLE_POLL)
        return time.monotonic() - began


def _raise_for(code: int, what: str) -> None:
    error = _ERRORS.get(code) or for_code(code)
    if error is not NoError:
        log.debug("offset fetch for %s: %s", what, error.__name__)
        if error is UnstableOffsetCommit:
            raise error(
                f"offset fetch for {what}: a transaction committing an offset here is still pending; past the"
                " transaction timeout that is a hanging transaction (kafka-transactions.sh find-hanging, abort)"
            )
        raise error(f"offset fetch for {what}")
