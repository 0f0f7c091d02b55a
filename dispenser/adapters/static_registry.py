"""A configured snowflake worker ID (``static`` mode): no coordinator, the local state file is the record.

The operator guarantees that no two workers share the ID. The high water comes from the local state file
alone (:mod:`dispenser.adapters.statefile`), which :meth:`StaticRegistry.report` keeps up to date, so a
restart never issues at or below a millisecond the previous run may have used.
"""

from __future__ import annotations

from typing import Final

from dispenser.adapters.statefile import LocalState, LocalStateFile
from dispenser.core.errors import WorkerIdOutOfRange
from dispenser.ports import WorkerLease

__all__ = ["StaticRegistry"]


class StaticRegistry:
    """:class:`~dispenser.ports.WorkerRegistry` for a configured worker ID.

    Args:
        worker_id: The configured ID.
        max_worker_id: The layout's largest worker ID.
        state: The local state file; without one the high water starts at 0 on every run (tests only).
        registry_name: The namespace recorded in the state file.

    Raises:
        WorkerIdOutOfRange: ``worker_id`` does not fit the layout.
    """

    mode: Final = "static"

    def __init__(
        self,
        worker_id: int,
        *,
        max_worker_id: int,
        state: LocalStateFile | None,
        registry_name: str = "static",
    ) -> None:
        if not 0 <= worker_id <= max_worker_id:
            raise WorkerIdOutOfRange(worker_id, max_worker_id)
        self.worker_id = worker_id
        self.max_worker_id = max_worker_id
        self.registry_name = registry_name
        self._state = state
        self._high_water = 0
        self._registered = False

    def __repr__(self) -> str:
        return f"StaticRegistry(worker_id={self.worker_id}, state={self._state!r})"

    async def register(self) -> WorkerLease:
        """Return the configured ID with the high water of the state file (0 if none, or of another ID).

        Raises:
            StateFileCorrupt: the state file cannot be read.
        """
        saved = self._state.load() if self._state is not None else None
        if (
            saved is not None
            and saved.worker_id == self.worker_id
            and saved.matches(self.mode, self.registry_name)
        ):
            self._high_water = max(self._high_water, saved.high_water_ms)
        self._registered = True
        return WorkerLease(worker_id=self.worker_id, high_water_ms=self._high_water)

    async def report(self, high_water_ms: int) -> None:
        """Save ``max(recorded, high_water_ms)`` to the state file (atomically, in a worker thread).

        Raises:
            OSError: the state file could not be written.
        """
        self._high_water = max(self._high_water, high_water_ms)
        if self._state is not None:
            await self._state.asave(
                LocalState(
                    worker_id=self.worker_id,
                    high_water_ms=self._high_water,
                    mode=self.mode,
                    registry_name=self.registry_name,
                )
            )

    def can_issue(self) -> bool:
        """True once registered: nobody else can take a configured ID."""
        return self._registered

    async def close(self) -> None:
        """Nothing to release."""
        self._registered = False
