"""Waiting on a shell's clock: ``wait_done``, the one primitive under ``wait_event`` and ``run_within``."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.service.timing import run_within, wait_done, wait_event
from dispenser.testing.clock import ManualClock


async def test_wait_done_returns_at_the_clocks_timeout_and_leaves_the_future_running() -> None:
    clock = ManualClock()
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(wait_done(clock, future, 0.5))
    await clock.advance(0.499)
    assert not waiting.done()
    await clock.advance(0.001)
    assert waiting.done()
    assert waiting.result() is False
    assert not future.cancelled()
    future.set_result(7)
    assert await wait_done(clock, future, 0.0) is True  # done: at once, whatever the timeout


async def test_wait_done_returns_when_the_future_is_done_before_the_timeout() -> None:
    clock = ManualClock()
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(wait_done(clock, future, 10.0))
    await clock.advance(1.0)
    future.set_result(1)
    await clock.advance(0.0)
    assert waiting.done()
    assert waiting.result() is True


async def test_wait_event_and_run_within_keep_their_answers() -> None:
    clock = ManualClock()
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_event(clock, event, 1.0))
    await clock.advance(0.999)
    assert not waiting.done()
    await clock.advance(0.001)
    assert waiting.done()
    assert waiting.result() is False
    event.set()
    assert await wait_event(clock, event, 0.0) is True
    slow = asyncio.create_task(run_within(clock, clock.sleep(5.0), 2.0))
    await clock.advance(1.999)
    assert not slow.done()
    await clock.advance(0.001)
    with pytest.raises(TimeoutError):
        slow.result()
    assert await run_within(clock, asyncio.sleep(0, result="x"), 1.0) == "x"
