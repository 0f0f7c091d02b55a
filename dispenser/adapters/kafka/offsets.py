"""A consumer group's committed offsets, read so that "unknown" is never mistaken for "never committed".

aiokafka's ``AIOKafkaConsumer.committed()`` (and the admin client's ``list_consumer_group_offsets``) look
only at the per-partition error codes of the OffsetFetch answer. Right after a broker restart the group
coordinator is still loading ``__consumer_offsets`` and answers with a *top-level* error
(COORDINATOR_LOAD_IN_PROGRESS) and no partitions at all, for ~0.1 to 0.6 s; aiokafka reads that as "no
committed offset" and returns ``None``. An enricher taking over a partition in that window would start it
over from the beginning and enrich every committed record a second time.

:class:`CommittedOffsets` sends the OffsetFetch itself, through aiokafka's public ``AIOKafkaClient``, and
accepts an answer only when both the top-level and the partition's error codes are 0 and the partition is
in it; anything else raises (a :class:`~aiokafka.errors.KafkaError`, retriable for the coordinator's
transient states), so the caller tries again instead of guessing. Only an error-free answer that lists the
partition with offset -1 means "this group never committed an offset for it".
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaClient, TopicPartition
from aiokafka.client import CoordinationType
from aiokafka.errors import GroupCoordinatorNotAvailableError, NoError, for_code
from aiokafka.protocol.commit import OffsetFetchRequest

from dispenser.adapters.kafka.clients import client_options
from dispenser.config import KafkaConfig

__all__ = ["CommittedOffsets", "UnknownCommittedOffset"]

log = logging.getLogger(__name__)

_NO_OFFSET = -1


class UnknownCommittedOffset(GroupCoordinatorNotAvailableError):  # type: ignore[misc]  # aiokafka is untyped
    """The coordinator answered without the partition: its committed offset is unknown (retriable)."""


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
        response = await self._client.send(node, OffsetFetchRequest(self.group, [(tp.topic, [tp.partition])]))
        # OffsetFetch v2 and later carry a group-level error; aiokafka's own readers ignore it.
        _raise_for(getattr(response, "error_code", 0), f"group {self.group!r}")
        for topic, partitions in response.topics:
            for partition, offset, _metadata, error_code in partitions:
                if (topic, partition) == (tp.topic, tp.partition):
                    _raise_for(error_code, f"{tp.topic}[{tp.partition}] of group {self.group!r}")
                    return None if offset == _NO_OFFSET else int(offset)
        raise UnknownCommittedOffset(f"the coordinator's answer for group {self.group!r} lacks {tp}")


def _raise_for(code: int, what: str) -> None:
    error = for_code(code)
    if error is not NoError:
        log.debug("offset fetch for %s: %s", what, error.__name__)
        raise error(f"offset fetch for {what}")
