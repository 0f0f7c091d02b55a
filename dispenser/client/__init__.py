"""Python clients of the dispenser: the buffered :class:`IdClient`, its blocking twin, the plain Kafka one.

:class:`IdClient` (NATS or Kafka) buffers ranges per tag in the caller's process; :class:`BlockingIdClient`
is the same for threads; :class:`KafkaIdClient` sends one request per call.

Example::

    async with IdClient.over_nats("nats://127.0.0.1:4222") as client:
        order_id = await client.next_id("order")

See ``docs/client.md``.
"""

from __future__ import annotations

from dispenser.client.blocking import BlockingIdClient
from dispenser.client.buffered import BufferSettings, ClientStats, IdClient, IdTransport
from dispenser.client.errors import DispenserUnavailable, IdRequestError
from dispenser.client.kafka import KafkaIdClient, KafkaIdTransport

__all__ = [
    "BlockingIdClient",
    "BufferSettings",
    "ClientStats",
    "DispenserUnavailable",
    "IdClient",
    "IdRequestError",
    "IdTransport",
    "KafkaIdClient",
    "KafkaIdTransport",
]
