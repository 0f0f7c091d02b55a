"""A configured snowflake worker ID (``static`` mode): no coordinator, the local state file is the record.

The operator guarantees that no two workers share the ID. Nothing remembers the high water here: like every
mode, the worker keeps it in the local state file (:class:`dispenser.registries.SnowflakeRegistration`),
which in this mode is the only record there is, so a restart never issues at or below a millisecond the
previous run may have used.
"""

from __future__ import annotations

from typing import Final

from dispenser.core.errors import WorkerIdOutOfRange
from dispenser.ports import WorkerLease

__all__ = ["StaticRegistry"]


class StaticRegistry:
    """:class:`~dispenser.ports.WorkerRegistry` for a configured worker ID.

    Args:
        worker_id: The configured ID.
        max_worker_id: The layout's largest worker ID.

    Raises:
        WorkerIdOutOfRange: ``worker_id`` does not fit the layout.
    """

    mode: Final = "static"

    def __init__(self, worker_id: int, *, max_worker_id: int) -> None:
        if not 0 <= worker_id <= max_worker_id:
            raise WorkerIdOutOfRange(worker_id, max_worker_id)
        self.worker_id = worker_id
        self.max_worker_id = max_worker_id
        self._high_water = 0
        self._registered = False

    def __repr__(self) -> str:
        return f"StaticRegistry(worker_id={self.worker_id})"

    async def register(self) -> WorkerLease:
        """Return the configured ID with the highest mark reported in this run (0 at first)."""
        self._registered = True
        return WorkerLease(worker_id=self.worker_id, high_water_ms=self._high_water)

    async def report(self, high_water_ms: int) -> None:
        """Remember ``max(recorded, high_water_ms)`` for a later :meth:`register`."""
        self._high_water = max(self._high_water, high_water_ms)

    def can_issue(self) -> bool:
        """True once registered: nobody else can take a configured ID."""
        return self._registered

    async def close(self) -> None:
        """Nothing to release."""
        self._registered = False
