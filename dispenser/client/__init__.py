"""Python clients of the dispenser: the buffered :class:`IdClient`, its blocking twin, the plain Kafka one.

:class:`IdClient` (NATS or Kafka) buffers ranges per tag in the caller's process; :class:`BlockingIdClient`
is the same for threads; :class:`KafkaIdClient` sends one request per call. See ``docs/client.md``. The
transports, where the drivers are imported, are the adapters' (``dispenser.adapters.nats.client_transport``,
``dispenser.adapters.kafka.client_transport``): this package imports no driver itself (an import contract).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dispenser.client.blocking import BlockingIdClient
from dispenser.client.buffered import BufferSettings, ClientStats, IdClient, IdTransport
from dispenser.client.errors import DispenserUnavailable, IdRequestError

if TYPE_CHECKING:
    from dispenser.client.kafka import KafkaIdClient, KafkaIdTransport

_KAFKA = frozenset({"KafkaIdClient", "KafkaIdTransport"})


def __getattr__(name: str) -> Any:
    """The Kafka clients, imported when first asked for: aiokafka is the ``[kafka]`` extra (docs/client.md)."""
    if name in _KAFKA:
        try:
            from dispenser.client import kafka  # noqa: PLC0415
        except ModuleNotFoundError as missing:
            raise ModuleNotFoundError(
                f"dispenser.client.{name} needs {missing.name}: pip install 'leaf-dispenser[kafka]'",
                name=missing.name,
            ) from missing
        return getattr(kafka, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
