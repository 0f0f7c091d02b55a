"""Waiting on the shell's :class:`~dispenser.ports.Clock`, so that tests can run it on virtual time."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dispenser.ports import Clock

__all__ = ["Deadlines", "run_within", "wait_done", "wait_event"]

T = TypeVar("T")


async def wait_done(clock: Clock, future: asyncio.Future[Any], timeout: float) -> bool:
    """Wait until ``future`` is done or ``timeout`` seconds of ``clock`` time have passed (it is not cancelled).

    Returns:
        Whether it is done. (``asyncio.wait_for`` and ``asyncio.wait(timeout=)`` time out on the event loop's
        clock, which a manual clock does not move.)
    """
    if future.done():
        return True
    if timeout <= 0:
        return False
    timer = asyncio.ensure_future(clock.sleep(timeout))
    try:
        await asyncio.wait((future, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    return future.done()


async def wait_event(clock: Clock, event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds of ``clock`` time have passed.

    Returns:
        Whether the event is set.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await wait_done(clock, waiter, timeout)
    finally:
        waiter.cancel()
    return event.is_set()


async def run_within(clock: Clock, work: Awaitable[T], timeout: float) -> T:
    """Await ``work`` for at most ``timeout`` seconds of ``clock`` time; cancel it when time is up.

    Raises:
        TimeoutError: the time ran out first (``work`` was cancelled).
    """
    task = asyncio.ensure_future(work)
    if not await wait_done(clock, task, timeout):
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise TimeoutError
    return task.result()


class Deadlines:
    """Waits on many futures, each until its own deadline on one clock, with one sleeping task for all.

    :func:`wait_done` costs two tasks and an ``asyncio.wait`` per call (measured: ~16 µs on uvloop), which
    a hot path that waits on every request cannot afford. Here a wait is a heap entry and done callbacks
    (:meth:`wait`), and without a waiter for a future its caller awaits itself (:meth:`expire`); one task
    sleeps until the earliest deadline still waited on, wakes (or fails) what is due, and goes back to
    sleep; it ends as soon as nothing is waited on (a worker that stops leaves no task behind).
    """

    def __init__(self, clock: Clock) -> None:
        """Deadlines on ``clock``'s monotonic time."""
        self._clock = clock
        # (deadline, order, future, error): at the deadline a future not done yet gets ``error()`` as its
        # exception, or ``None`` as its result when ``error`` is None (a waiter of :meth:`wait`).
        self._heap: list[tuple[float, int, asyncio.Future[Any], Callable[[], BaseException] | None]] = []
        self._order = itertools.count()
        self._live = 0
        """Entries whose future is not done yet."""
        self._sleeper: asyncio.Task[None] | None = None
        self._wake_at = math.inf

    async def wait(self, future: asyncio.Future[Any], deadline: float) -> bool:
        """Wait until ``future`` is done or the clock reaches ``deadline`` (``future`` is not cancelled).

        Returns:
            Whether ``future`` is done.
        """
        if future.done():
            return True
        if deadline <= self._clock.monotonic():
            return False
        waiter: asyncio.Future[None] = future.get_loop().create_future()

        def wake(_: object) -> None:
            if not waiter.done():
                waiter.set_result(None)

        future.add_done_callback(wake)
        self._push(deadline, waiter, None)
        try:
            await waiter
        finally:
            future.remove_done_callback(wake)
            waiter.cancel()  # a waiter cancelled from outside: its entry is dropped at the next wake-up
        return future.done()

    def expire(
        self, future: asyncio.Future[Any], deadline: float, error: Callable[[], BaseException]
    ) -> None:
        """Fail ``future`` with ``error()`` when the clock reaches ``deadline``, unless it is done by then.

        For a plain future its caller awaits (not a task: a task is cancelled, not failed): no waiter, one
        heap entry.
        """
        if future.done():
            return
        if deadline <= self._clock.monotonic():
            future.set_exception(error())
            return
        self._push(deadline, future, error)

    def _push(
        self, deadline: float, future: asyncio.Future[Any], error: Callable[[], BaseException] | None
    ) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), future, error))
        self._live += 1
        future.add_done_callback(self._gone)
        if deadline < self._wake_at:
            self._restart(deadline)

    def _gone(self, _: object) -> None:
        """One wait over: when none is left, neither are the heap's entries nor the sleeping task."""
        self._live -= 1
        if self._live == 0:
            self._heap.clear()
            if self._sleeper is not None:
                self._sleeper.cancel()
                self._sleeper = None
                self._wake_at = math.inf

    def _restart(self, deadline: float) -> None:
        if self._sleeper is not None:
            self._sleeper.cancel()
        self._sleeper = asyncio.get_running_loop().create_task(self._sleep(), name="deadlines")
        # Known now, not once the new task first runs: the requests NATS hands over in the same turn of the
        # loop (64 in flight arrive together) would each replace it with a task of their own (measured: one
        # made and cancelled per request_id request). It sleeps until the heap's earliest, this or before.
        self._wake_at = deadline

    async def _sleep(self) -> None:
        heap = self._heap
        try:
            while True:
                now = self._clock.monotonic()
                # Entries whose wait is over (answered, or cancelled) go, whatever their deadline, so that
                # the sleep below is for a request still waiting; those whose deadline has come are woken.
                while heap and (heap[0][2].done() or heap[0][0] <= now):
                    _, _, future, error = heapq.heappop(heap)
                    if future.done():
                        continue
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error())
                if not heap:
                    return
                self._wake_at = heap[0][0]
                await self._clock.sleep(self._wake_at - now)
        finally:
            if self._sleeper is asyncio.current_task():
                self._sleeper = None
                self._wake_at = math.inf
