"""What the worker's observers read of it: ``/metrics`` (adapters/prometheus.py) and the status page.

One protocol for both, so the two read the same parts under the same names; the worker hands them
``dispenser.app.operations.Observed``, where a part that is off is ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from dispenser.ports import Clock
from dispenser.service.dispatch import Dispatcher
from dispenser.service.rates import RateBook
from dispenser.service.segments import SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator

__all__ = ["ObservedWorker"]


class ObservedWorker(Protocol):
    """A running worker's parts, as its observers read them (``None``: the part is off)."""

    @property
    def clock(self) -> Clock:
        """The worker's clock."""
        ...

    @property
    def rates(self) -> RateBook:
        """Its rate meters, its peers' events and the step rule."""
        ...

    @property
    def dispatchers(self) -> Mapping[str, Dispatcher]:
        """Its dispatchers by kind (their counters)."""
        ...

    @property
    def allocator(self) -> SegmentAllocator | None:
        """Its segment allocator, if segments are on."""
        ...

    @property
    def snowflake(self) -> SnowflakeGenerator | None:
        """Its snowflake generator, if snowflake is on."""
        ...
