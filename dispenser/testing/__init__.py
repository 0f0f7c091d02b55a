"""A test kit for code that uses the dispenser, and for the dispenser's own tests (as ``trio.testing`` is).

Fakes held to the adapters' contract tests (:mod:`~dispenser.testing.fakes`), virtual time
(:mod:`~dispenser.testing.clock`), real servers (:mod:`~dispenser.testing.servers`) and a TCP fault proxy
(:mod:`~dispenser.testing.faultproxy`). See ``docs/testing.md``.
"""

from dispenser.testing.clock import ManualClock, settle
from dispenser.testing.fakes import (
    MemoryReplayStore,
    MemorySegmentStore,
    MemoryWorkerRegistry,
    MemoryWorkerTable,
)
from dispenser.testing.faultproxy import Direction, FaultProxy, ThreadedFaultProxy

__all__ = [
    "Direction",
    "FaultProxy",
    "ManualClock",
    "MemoryReplayStore",
    "MemorySegmentStore",
    "MemoryWorkerRegistry",
    "MemoryWorkerTable",
    "ThreadedFaultProxy",
    "settle",
]
