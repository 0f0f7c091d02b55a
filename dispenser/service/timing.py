"""Waiting on the shell's :class:`~dispenser.ports.Clock`, so that tests can run it on virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from dispenser.ports import Clock

__all__ = ["run_within", "wait_done", "wait_event"]

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
