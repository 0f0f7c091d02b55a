"""A test kit for code that uses the dispenser, and for the dispenser's own tests (as ``trio.testing`` is).

* :mod:`dispenser.testing.fakes`: in-memory segment store, replay store and worker registry, held to the
  same contract tests as the PostgreSQL and ZooKeeper adapters (``tests/contract/``).
* :mod:`dispenser.testing.clock`: :class:`ManualClock`, virtual time for the shells (a two-second deadline
  tested to the millisecond in microseconds).
* :mod:`dispenser.testing.servers`: real NATS, PostgreSQL, ZooKeeper and Kafka servers on 127.0.0.1 and free
  ports, started as subprocesses and stopped by PID (what the suite and ``dispenser dev`` run).
* :mod:`dispenser.testing.faultproxy`: :class:`FaultProxy`, a TCP proxy to put between a client and a
  server, which adds latency, blackholes, cuts one direction or resets connections on demand.
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
