"""What the buffered client is built from and reports: its transport, its settings, a tag's costs, its runs.

Split from :mod:`dispenser.client.buffered`, which re-exports them (``docs/client.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dispenser.messages import IdRequest, Kind, Reply

__all__ = ["BufferSettings", "ClientStats", "IdTransport", "next_run"]

_RUN_SECONDS_LOW = 0.001
"""A cursor run that lasted less than this doubles the next run (up to :data:`_MAX_RUN`)."""
_RUN_SECONDS_HIGH = 0.02
"""A cursor run that lasted more than this halves the next run (down to one ID)."""
_MAX_RUN = 4096
"""The longest cursor run: the meter hears of consumption at least every this many IDs."""


class IdTransport(Protocol):
    """How the client reaches the dispensers.

    NATS: :class:`dispenser.adapters.nats.client_transport.NatsIdTransport`; Kafka:
    :class:`dispenser.adapters.kafka.client_transport.KafkaIdTransport`.
    """

    async def start(self) -> None:
        """Connect. Raises :class:`OSError` when the broker cannot be reached."""

    async def close(self) -> None:
        """Disconnect."""

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """One request, its reply (error replies included).

        Raises:
            TimeoutError: no reply within ``timeout`` seconds.
            OSError: no worker serves the tag, or the broker cannot be reached.
        """


@dataclass(frozen=True, slots=True)
class BufferSettings:
    """How much the client holds per tag, and how long it waits."""

    buffer_seconds: float = 3.0
    """A range holds this many seconds of the client's measured rate (its peak of the last minute)."""
    min_buffer: int = 100
    """The smallest range asked for (the first one, and at low rates)."""
    max_buffer: int = 1_000_000
    """The largest range asked for (the workers' ``limits.max_ranges`` caps a request anyway)."""
    max_request: int = 1_000_000
    """The most IDs one request asks for (the workers' ``limits.max_ranges``); a bigger ``take`` needs several."""
    timeout: float = 5.0
    """Seconds a call waits for IDs when the buffer is empty and no outage is known yet."""
    request_timeout: float = 3.0
    """Seconds a request waits for its reply (above the workers' ``segment.fetch_deadline``, 2 s)."""
    retry_initial: float = 0.05
    """First pause after a refill failed, doubling up to ``retry_max``."""
    retry_max: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer_seconds <= 0:
            raise ValueError(f"buffer_seconds must be positive, got {self.buffer_seconds}")
        if not 1 <= self.min_buffer <= self.max_buffer:
            raise ValueError(f"need 1 <= min_buffer <= max_buffer, got {self.min_buffer}, {self.max_buffer}")
        if self.max_request < 1:
            raise ValueError(f"max_request must be at least 1, got {self.max_request}")


@dataclass(frozen=True, slots=True)
class ClientStats:
    """What one tag cost (segment kind), since the client started."""

    tag: str
    requests: int
    """Requests sent to the workers for refills (retries included)."""
    ids_received: int
    """IDs in the ranges received (those dropped included)."""
    ids_dropped: int
    """IDs received and skipped: below those already held (a worker behind another), or above the range
    asked for when a request carried the gap to a worker behind (the worker ahead answered it)."""
    ids_held: int
    """IDs in hand now (cursor and buffer): skipped if the client exits."""
    last_range: int | None
    """The size of the last range asked for."""

    @property
    def ids_handed_out(self) -> int:
        """IDs returned to callers."""
        return self.ids_received - self.ids_dropped - self.ids_held


def next_run(run: int, lasted: float, fast: float = _RUN_SECONDS_LOW, slow: float = _RUN_SECONDS_HIGH) -> int:
    """The length of a cursor's next run, from how long its last run of ``run`` IDs lasted.

    Doubled (up to :data:`_MAX_RUN`) when it went in under ``fast`` seconds, halved (down to 1) past
    ``slow``: a busy caller comes back for more rarely, a quiet one holds few IDs it may never use.
    """
    if lasted < fast:
        return min(run * 2, _MAX_RUN)
    if lasted > slow:
        return max(run // 2, 1)
    return run
