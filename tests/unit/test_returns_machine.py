"""No returned range is handed out twice, whatever workers do, in any order (hypothesis stateful, memory store).

Workers take, stop cleanly (returning their rest), crash and start, with grants in flight at a stop.

The invariant is the product's first promise: no ID twice, across every worker of the fleet and every range
given back (docs/segment.md, "Unused IDs returned on a clean stop").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dispenser.service.returns import return_unused
from dispenser.service.segments import SegmentAllocator
from dispenser.testing.clock import ManualClock, settle
from tests.unit.returns_support import FAST, SlowReplyStore

T = TypeVar("T")

TAG = "order"


class ReturnsMachine(RuleBasedStateMachine):
    """Up to three workers on one tag of step 50; every ID any of them hands out is checked against all."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.store = SlowReplyStore()
        self.run(self.store.add_tag(TAG, 50))
        self.workers: dict[int, SegmentAllocator] = {}
        self.takes: list[asyncio.Task[list[int]]] = []
        self.handed: set[int] = set()
        self.count = 0  # IDs handed out, for the invariant that none came twice
        self.started = 0
        self.returned = 0

    def run(self, awaitable: Awaitable[T]) -> T:
        return self.loop.run_until_complete(awaitable)

    def settle(self) -> None:
        self.run(settle())
        self.collect()

    def collect(self) -> None:
        """Count the IDs of every take that finished; a take refused (its worker stopped) hands out none."""
        for task in [t for t in self.takes if t.done()]:
            self.takes.remove(task)
            if task.cancelled() or task.exception() is not None:
                continue
            ids = task.result()
            assert not self.handed.intersection(ids), (
                f"handed out twice: {sorted(self.handed.intersection(ids))}"
            )
            self.handed.update(ids)
            self.count += len(ids)

    @precondition(lambda self: len(self.workers) < 3)
    @rule()
    def start(self) -> None:
        """A worker starts (a new process: nothing of a stopped one is kept)."""
        allocator = SegmentAllocator(self.store, self.clock, FAST)
        self.run(allocator.refresh())
        self.workers[self.started] = allocator
        self.started += 1

    @precondition(lambda self: bool(self.workers))
    @rule(data=st.data(), count=st.integers(1, 120))
    def take(self, data: st.DataObject, count: int) -> None:
        """A request; it may wait for a grant held back by the gate."""
        name = data.draw(st.sampled_from(sorted(self.workers)))
        allocator = self.workers[name]

        async def draw() -> list[int]:
            batch = await allocator.take(TAG, count, self.clock.monotonic() + 1)
            return [i for first, last in batch.ranges for i in range(first, last + 1)]

        self.takes.append(self.loop.create_task(draw()))
        self.settle()

    @rule(hold=st.booleans())
    def gate(self, hold: bool) -> None:
        """Grants answered late (in flight across the next rules), or answered again."""
        if hold:
            self.store.gate.clear()
        else:
            self.store.gate.set()
        self.settle()

    @precondition(lambda self: bool(self.workers))
    @rule(data=st.data())
    def stop_cleanly(self, data: st.DataObject) -> None:
        """SIGTERM: the worker returns the rest of its segments (a grant in flight lands and goes back too)."""
        name = data.draw(st.sampled_from(sorted(self.workers)))
        allocator = self.workers.pop(name)
        stopping = self.loop.create_task(return_unused(allocator, self.store, f"w{name}", self.clock, 2.0))
        self.settle()
        if not stopping.done():  # waiting for its grant in flight: let it land
            self.store.gate.set()
            self.settle()
        self.run(stopping)
        self.returned += 1
        self.run(allocator.close())
        self.settle()

    @precondition(lambda self: bool(self.workers))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """Kill -9: the rest of its segments is lost (a gap), never handed out by anyone."""
        name = data.draw(st.sampled_from(sorted(self.workers)))
        self.run(self.workers.pop(name).close())
        self.settle()

    @invariant()
    def no_id_twice(self) -> None:
        assert len(self.handed) == self.count

    def teardown(self) -> None:
        self.store.gate.set()
        self.settle()
        for allocator in self.workers.values():
            self.run(allocator.close())
        for task in self.takes:
            task.cancel()
        self.run(settle())
        self.loop.close()


ReturnsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestReturns = ReturnsMachine.TestCase


def test_the_machine_sees_returned_ids_handed_out_again() -> None:
    """The machine can reach what it guards: a returned rest handed out by the next worker (not a vacuous run)."""
    machine = ReturnsMachine()
    try:
        machine.start()
        machine.takes.append(machine.loop.create_task(_draw(machine, 0, 10)))
        machine.settle()
        first = machine.workers.pop(0)
        assert machine.run(return_unused(first, machine.store, "w0", machine.clock, 2.0)).kept > 0
        machine.run(first.close())
        machine.start()
        machine.takes.append(machine.loop.create_task(_draw(machine, 1, 10)))
        machine.settle()
        assert sorted(machine.handed) == list(range(1, 21))  # 11..20 came back and went out once
    finally:
        machine.teardown()


async def _draw(machine: ReturnsMachine, name: int, count: int) -> list[int]:
    batch = await machine.workers[name].take(TAG, count, machine.clock.monotonic() + 1)
    return [i for first, last in batch.ranges for i in range(first, last + 1)]
