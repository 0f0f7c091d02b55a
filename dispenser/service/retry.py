"""Retrying with capped exponential back-off, and stopping a retry loop when the process is asked to stop.

Every hand-written retry loop of the worker uses one :class:`Backoff` (:meth:`Backoff.attempt` and
:meth:`Backoff.wait` raise :class:`Stopped` once ``stop`` is set). Why not tenacity, backoff or stamina:
``docs/development.md`` ("Dependencies we lean on").
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from typing import TypeVar

from dispenser.ports import Clock, SystemClock
from dispenser.service.timing import wait_event

__all__ = ["Backoff", "Stopped"]

T = TypeVar("T")


class Stopped(Exception):
    """The stop event was set while retrying: the loop ends without a result (the work is left undone)."""

    def __init__(self) -> None:
        super().__init__("stopped while retrying")


class Backoff:
    """Delays between attempts: ``initial`` seconds, doubled after each wait, never above ``cap``.

    Args:
        initial: the first delay (seconds).
        cap: the longest delay.
        stop: when set, :meth:`wait` and :meth:`attempt` raise :class:`Stopped` (at once, not after the
            delay or the attempt); ``None``: only cancellation ends the loop.
        clock: whose time the delays are (tests pass a manual clock).
        jitter: each sleep is the delay times a random factor in ``[1 - jitter, 1 + jitter]``, so that
            workers that failed together do not all retry in the same instant.

    Example::

        backoff = Backoff(0.1, 5.0, stop=stop)
        while True:
            try:
                return await backoff.attempt(fetch())  # Stopped, the attempt cancelled, once stop is set
            except StoreUnavailable:
                await backoff.wait()  # Stopped at once if stop is set meanwhile
    """

    __slots__ = ("_clock", "_jitter", "_stop", "cap", "delay", "initial")

    def __init__(
        self,
        initial: float,
        cap: float,
        *,
        stop: asyncio.Event | None = None,
        clock: Clock | None = None,
        jitter: float = 0.0,
    ) -> None:
        if not 0 < initial <= cap:
            raise ValueError(f"need 0 < initial <= cap, got initial={initial} and cap={cap}")
        if not 0 <= jitter < 1:
            raise ValueError(f"need 0 <= jitter < 1, got {jitter}")
        self._jitter = jitter
        self.initial = initial
        self.cap = cap
        self.delay = initial
        """The next :meth:`wait`'s delay."""
        self._stop = stop
        self._clock = clock or SystemClock()

    @property
    def stopped(self) -> bool:
        """Whether the stop event is set."""
        return self._stop is not None and self._stop.is_set()

    def reset(self) -> None:
        """Start again from the initial delay (after a success, for the next outage)."""
        self.delay = self.initial

    async def wait(self) -> None:
        """Sleep the current delay, then double it (up to the cap).

        Raises:
            Stopped: the stop event is set, or was set during the sleep (which then ends at once).
        """
        delay = self.delay
        self.delay = min(delay * 2, self.cap)
        if self._jitter:
            delay *= random.uniform(1 - self._jitter, 1 + self._jitter)
        if self._stop is None:
            await self._clock.sleep(delay)
        elif await wait_event(self._clock, self._stop, delay):
            raise Stopped

    async def attempt(self, work: Awaitable[T]) -> T:
        """Await ``work``; if the stop event is set first, cancel it.

        Raises:
            Stopped: the stop event was set before ``work`` finished (``work`` is cancelled).
            Exception: whatever ``work`` raises.
        """
        stop = self._stop
        if stop is None:
            return await work
        task = asyncio.ensure_future(work)
        if stop.is_set():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise Stopped
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled() and stop.is_set():
            raise Stopped
        return task.result()
