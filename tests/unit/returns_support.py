"""Store fakes the unit tests of returned ranges share (tests/unit/test_returns.py, test_returns_machine.py)."""

from __future__ import annotations

import asyncio

from dispenser.ports import Allocation
from dispenser.service.segments import AllocatorSettings
from dispenser.testing.fakes import MemorySegmentStore

__all__ = ["FAST", "SlowReplyStore"]

FAST = AllocatorSettings(retry_initial=0.01, retry_max=0.02, unknown_tag_refresh_interval=0.0)


class SlowReplyStore(MemorySegmentStore):
    """The memory store, whose grants' replies are held while ``gate`` is clear (granted, not yet answered)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        allocation = await super().next_segment(tag, step, above=above)
        await self.gate.wait()
        return allocation
