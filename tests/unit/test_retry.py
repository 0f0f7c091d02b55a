"""Backoff: doubling delays up to a cap, on the given clock, and a stop event that ends waits and attempts."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.service.retry import Backoff, Stopped
from dispenser.testing.clock import ManualClock, settle


async def _wait_takes(clock: ManualClock, backoff: Backoff, seconds: float) -> bool:
    """Whether one ``backoff.wait()`` ends just after ``seconds`` of the clock (not 1 ms before)."""
    waiting = asyncio.create_task(backoff.wait())
    await clock.advance(seconds - 0.001)
    early = waiting.done()
    await clock.advance(0.002)
    on_time = waiting.done()
    await waiting
    return on_time and not early


async def test_delays_double_up_to_the_cap_and_reset() -> None:
    """0.1, 0.2, 0.4, then the cap 0.5 for good; reset() starts again from 0.1."""
    clock = ManualClock()
    backoff = Backoff(0.1, 0.5, clock=clock)
    for delay in (0.1, 0.2, 0.4, 0.5, 0.5):
        assert await _wait_takes(clock, backoff, delay), delay
    backoff.reset()
    assert backoff.delay == 0.1
    assert await _wait_takes(clock, backoff, 0.1)


async def test_jitter_stays_within_its_band() -> None:
    """With jitter 0.2, each sleep is within ±20 % of the delay (here the cap, 1 s)."""
    clock = ManualClock()
    backoff = Backoff(1.0, 1.0, clock=clock, jitter=0.2)
    for _ in range(20):
        waiting = asyncio.create_task(backoff.wait())
        await clock.advance(0.799)
        assert not waiting.done()
        await clock.advance(0.402)
        assert waiting.done()
        await waiting


async def test_a_stop_during_a_wait_ends_it_at_once() -> None:
    """The stop event set 1 s into a 5 s wait: Stopped, without the clock moving further."""
    clock = ManualClock()
    stop = asyncio.Event()
    backoff = Backoff(5.0, 5.0, stop=stop, clock=clock)
    waiting = asyncio.create_task(backoff.wait())
    await clock.advance(1.0)
    assert not waiting.done()
    stop.set()
    await settle()
    with pytest.raises(Stopped):
        await waiting
    with pytest.raises(Stopped):  # and every later wait, at once
        await backoff.wait()


async def test_a_stop_cancels_an_attempt_that_hangs() -> None:
    """An attempt that never ends (a server that does not answer) is cancelled when stop is set."""
    stop = asyncio.Event()
    backoff = Backoff(0.1, 1.0, stop=stop)
    cancelled = asyncio.Event()

    async def hangs() -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    attempt = asyncio.create_task(backoff.attempt(hangs()))
    await settle()
    assert not attempt.done()
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(attempt, 10)
    assert cancelled.is_set()


async def test_an_attempt_returns_its_result_or_raises_its_error() -> None:
    """Without a stop, attempt() is the awaitable's own outcome."""
    backoff = Backoff(0.1, 1.0, stop=asyncio.Event())

    async def fine() -> int:
        return 7

    async def fails() -> int:
        raise ConnectionRefusedError("down")

    assert await backoff.attempt(fine()) == 7
    with pytest.raises(ConnectionRefusedError, match="down"):
        await backoff.attempt(fails())


def test_bad_settings_are_refused() -> None:
    """A zero or negative delay, a cap below the first delay, or jitter of 1 or more is a ValueError."""
    for initial, cap, jitter in ((0.0, 1.0, 0.0), (2.0, 1.0, 0.0), (0.1, 1.0, 1.0)):
        with pytest.raises(ValueError, match="need"):
            Backoff(initial, cap, jitter=jitter)
