"""dispenser.testing.settle: runs the loop until it is idle, not for a guessed number of turns."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.testing import ManualClock, settle


async def test_a_long_chain_of_wake_ups_runs_to_its_end() -> None:
    """Each task wakes the next one; far more turns than the old fixed 20 are needed, and all run."""
    events = [asyncio.Event() for _ in range(200)]
    reached: list[int] = []

    async def link(n: int) -> None:
        await events[n].wait()
        for _ in range(3):
            await asyncio.sleep(0)
        reached.append(n)
        if n + 1 < len(events):
            events[n + 1].set()

    tasks = [asyncio.create_task(link(n)) for n in range(len(events))]
    events[0].set()
    await settle()
    assert reached == list(range(200))
    await asyncio.gather(*tasks)


async def test_tasks_waiting_on_what_is_not_done_let_it_return() -> None:
    """A task parked on an event or a ManualClock sleep is idle: settle returns without them."""
    clock = ManualClock()
    gate = asyncio.Event()
    parked = [asyncio.create_task(gate.wait()), asyncio.create_task(clock.sleep(5))]
    await settle()
    assert not any(task.done() for task in parked)
    gate.set()
    await clock.advance(5)
    assert all(task.done() for task in parked)


async def test_a_spinning_task_is_reported_not_waited_for() -> None:
    """A task that never parks (a loop on sleep(0)) makes settle fail, naming it."""

    async def spin() -> None:
        while True:  # noqa: ASYNC110 - the busy loop is the point
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin(), name="spinner")
    try:
        with pytest.raises(AssertionError, match="spinner"):
            await settle(limit=500)
    finally:
        spinner.cancel()
