"""Virtual time for tests: a :class:`~dispenser.ports.Clock` that moves only when the test moves it."""

from __future__ import annotations

import asyncio
import heapq
import os
import selectors
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

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


_LOOP_CODE = (os.path.dirname(asyncio.__file__), selectors.__file__)
"""Where the event loop's own code lives, when it is asyncio's pure-Python loop rather than uvloop."""


async def settle(limit: int = 10_000) -> None:
    """Let the event loop run what is ready until it is idle: a turn of it in which no other code ran.

    Idle means no other task (and no plain callback) ran any Python code for two turns of the loop in a
    row: each other task is done or parked on something not done yet (a lock, an event, a
    :class:`ManualClock` sleep, a socket), since a task that was just woken, or that yields with
    ``asyncio.sleep(0)``, runs within one turn. That is the state a test means by "whatever was set off
    has run", so nothing here is a guessed number of turns. Seen with public API only: a profile function
    (:func:`sys.setprofile`, this thread, only while settling) notes every frame another task
    (:func:`asyncio.current_task`) enters or resumes.

    Raises:
        AssertionError: still busy after ``limit`` loop turns (a task spinning on ``sleep(0)``), naming it.
    """
    me = asyncio.current_task()
    ran: set[asyncio.Task[Any] | None] = set()

    def seen(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":  # a frame entered, or a coroutine resumed
            task = asyncio.current_task()
            # Outside any task, the pure-Python event loop's own turn (asyncio's and selectors' code) is
            # not work; a callback it runs is, and a task it wakes runs in the next turn.
            if task is not me and (task is not None or not frame.f_code.co_filename.startswith(_LOOP_CODE)):
                ran.add(task)

    quiet = 0
    previous = sys.getprofile()
    sys.setprofile(seen)
    try:
        for _ in range(limit):
            ran.clear()
            await asyncio.sleep(0)
            # Twice in a row: a plain callback that was ready beside the tasks has run, and woken no one.
            quiet = quiet + 1 if not ran else 0
            if quiet == 2:
                return
    finally:
        sys.setprofile(previous)
    busy = sorted(repr(task) if task is not None else "a plain callback" for task in ran)
    raise AssertionError(f"the event loop is still busy after {limit} turns: {busy}")
