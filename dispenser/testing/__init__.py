"""A test kit for code that uses the dispenser (as ``trio.testing`` is for trio's users).

Fakes held to the adapters' contract tests (:mod:`~dispenser.testing.fakes`) and virtual time
(:mod:`~dispenser.testing.clock`). The real servers and the fault proxy the dispenser's own tests start are
the lab's (``dispenser_lab.servers``, ``dispenser_lab.faultproxy``: ``lab/`` in the repository, a
distribution of its own). See ``docs/testing.md``.
"""

from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import (
    MemoryReplayStore,
    MemorySegmentStore,
    MemoryWorkerRegistry,
    MemoryWorkerTable,
)

__all__ = [
    "ManualClock",
    "MemoryReplayStore",
    "MemorySegmentStore",
    "MemoryWorkerRegistry",
    "MemoryWorkerTable",
    "settle",
]
