"""Virtual time for tests: a :class:`~dispenser.ports.Clock` that moves only when the test moves it."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable

__all__ = ["ManualClock", "settle"]


class ManualClock:
    """A :class:`~dispenser.ports.Clock` on virtual time: it moves only when a test moves it.

    ``sleep`` parks the caller until :meth:`advance` carries the clock past its wake-up time; sleepers wake
    in time order, and the event loop runs whatever they set off before the clock moves on, so a test
    of a two-second deadline takes microseconds and never races the machine's load. The wall clock runs
    with the monotonic one.
    """

    def __init__(self, monotonic: float = 1_000.0, wall_ms: int = 1_700_000_000_000) -> None:
        """Start at ``monotonic`` seconds and ``wall_ms`` Unix milliseconds."""
        self._now = monotonic
        self._wall_offset_ms = wall_ms - int(monotonic * 1000)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = 0

    def monotonic(self) -> float:
        """Virtual seconds."""
        return self._now

    def wall_ms(self) -> int:
        """Virtual Unix milliseconds (moves with :meth:`monotonic`)."""
        return int(self._now * 1000) + self._wall_offset_ms

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds`` (at once, after one loop turn, if ≤ 0)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._order += 1
        heapq.heappush(self._sleepers, (self._now + seconds, self._order, future))
        await future

    async def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``, waking each sleeper at its time and letting it run."""
        target = self._now + seconds
        await settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            when, _, future = heapq.heappop(self._sleepers)
            self._now = max(self._now, when)
            if not future.done():
                future.set_result(None)
                await settle()
        self._now = target
        await settle()

    async def run_until(
        self, condition: Callable[[], bool], step: float = 0.01, limit: float = 60.0
    ) -> float:
        """Advance in ``step``s until ``condition()`` holds; return the virtual seconds that took.

        Raises:
            AssertionError: ``limit`` virtual seconds passed first.
        """
        started = self._now
        await settle()
        while not condition():
            if self._now - started > limit:
                raise AssertionError(f"condition not met within {limit} virtual seconds")
            await self.advance(step)
        return self._now - started


async def settle(limit: int = 10_000) -> None:
    """Let the event loop run what is ready until it is idle: every other task waits on something undone.

    Idle means each other task is done or parked on a future that is not done yet (a lock, an event, a
    :class:`ManualClock` sleep, a socket); a task that was just woken, or that yields with
    ``asyncio.sleep(0)``, is not. That is the state a test means by "whatever was set off has run", so
    nothing here is a guessed number of turns.

    Raises:
        AssertionError: still busy after ``limit`` loop turns (a task spinning on ``sleep(0)``).
    """
    me = asyncio.current_task()
    quiet = 0
    for _ in range(limit):
        await asyncio.sleep(0)
        if all(_parked(task) for task in asyncio.all_tasks() if task is not me):
            # Twice in a row: a plain callback (call_soon) that was ready beside the tasks has run, and
            # woken no one.
            quiet += 1
            if quiet == 2:
                return
        else:
            quiet = 0
    busy = [task for task in asyncio.all_tasks() if task is not me and not _parked(task)]
    raise AssertionError(f"the event loop is still busy after {limit} turns: {busy}")


def _parked(task: asyncio.Task[object]) -> bool:
    """Done, or waiting on a future that is not done (so no step of it is scheduled)."""
    if task.done():
        return True
    # The future a task waits on: asyncio's own attribute, on the C and the Python Task alike (uvloop
    # runs asyncio's Task). None while a step of the task is scheduled.
    waiter = getattr(task, "_fut_waiter", None)
    return waiter is not None and not waiter.done()
