"""The plain Kafka client, one request per call: ``await client.ids("order", 100)``.

Its requests and replies are the Kafka adapter's (:mod:`dispenser.adapters.kafka.client_transport`, where
aiokafka is imported); this adds the calls that hand out IDs and raise :class:`IdRequestError` for an error
reply. See ``docs/kafka.md``.
"""

from __future__ import annotations

from dispenser.adapters.kafka.client_transport import KafkaIdRequester, KafkaIdTransport
from dispenser.client.errors import IdRequestError
from dispenser.messages import Reply

# KafkaIdTransport: public as dispenser.client.KafkaIdTransport (its home is the Kafka adapter).
__all__ = ["KafkaIdClient", "KafkaIdTransport"]


class KafkaIdClient(KafkaIdRequester):
    """Ask the dispensers for IDs over Kafka; one instance serves any number of concurrent requests.

    Args:
        config: servers and credentials (``request_topic`` and ``reply_topic`` are used too).
        reply_topic: where replies should go; default ``config.reply_topic``.
        reply_partition: ask for replies on this partition only (and read only it); default: read all.
        timeout: seconds a request waits for its reply by default.
        msgpack: send msgpack instead of JSON (replies come back in the same encoding).
    """

    async def ids(self, tag: str, count: int = 1, **options: object) -> list[int]:
        """``count`` IDs of ``tag`` as a list (options as for :meth:`request`).

        Raises:
            IdRequestError: the dispenser answered with an error.
            TimeoutError: no reply in time.
        """
        reply = await self.request(tag, count, format="ids", **options)  # type: ignore[arg-type]
        _raise_for_error(reply)
        assert reply.ids is not None
        return reply.ids

    async def ranges(self, tag: str, count: int = 1, **options: object) -> list[tuple[int, int]]:
        """``count`` IDs of ``tag`` as inclusive ``(first, last)`` ranges (options as for :meth:`request`).

        Raises:
            IdRequestError: the dispenser answered with an error.
            TimeoutError: no reply in time.
        """
        reply = await self.request(tag, count, format="ranges", **options)  # type: ignore[arg-type]
        _raise_for_error(reply)
        assert reply.ranges is not None
        return [(first, last) for first, last in reply.ranges]


def _raise_for_error(reply: Reply) -> None:
    if reply.error is not None:
        raise IdRequestError(reply.error.code, reply.error.message, reply.error.retryable)
