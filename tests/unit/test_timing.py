"""Waiting on a shell's clock: ``wait_done`` (under ``wait_event`` and ``run_within``) and ``Deadlines``."""

from __future__ import annotations

import asyncio

import pytest

from dispenser.service.timing import Deadlines, run_within, wait_done, wait_event
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


async def test_deadlines_wake_each_waiter_at_its_own_deadline_and_leave_its_future_running() -> None:
    """Waiters with deadlines out of order: each returns ``False`` at its own, its future untouched."""
    clock = ManualClock()
    deadlines = Deadlines(clock)
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[int]] = [loop.create_future() for _ in range(3)]
    at = [clock.monotonic() + offset for offset in (2.0, 0.5, 1.0)]
    waiting = [asyncio.create_task(deadlines.wait(f, when)) for f, when in zip(futures, at, strict=True)]
    await clock.advance(0.499)
    assert not any(task.done() for task in waiting)
    await clock.advance(0.001)
    assert [task.done() for task in waiting] == [False, True, False]
    await clock.advance(0.5)
    assert [task.done() for task in waiting] == [False, True, True]
    await clock.advance(1.0)
    assert [task.result() for task in waiting] == [False, False, False]
    assert not any(f.done() for f in futures)


async def test_deadlines_return_when_the_future_is_done_and_forget_it() -> None:
    """A future done before its deadline: ``True`` at once; a deadline already past: ``False`` at once."""
    clock = ManualClock()
    deadlines = Deadlines(clock)
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[int] = loop.create_future()
    waiting = asyncio.create_task(deadlines.wait(answered, clock.monotonic() + 10.0))
    later: asyncio.Future[int] = loop.create_future()
    still = asyncio.create_task(deadlines.wait(later, clock.monotonic() + 20.0))
    await clock.advance(1.0)
    answered.set_result(1)
    await clock.advance(0.0)
    assert waiting.result() is True
    assert not still.done()
    await clock.advance(19.0)  # the answered one's deadline passed on the way: nothing woke early
    assert still.result() is False
    assert await deadlines.wait(answered, clock.monotonic() - 1.0) is True
    assert await deadlines.wait(later, clock.monotonic()) is False


async def test_a_cancelled_waiter_leaves_the_others_on_time() -> None:
    """Cancelling one waiter (its request stopped) neither wakes nor delays the others."""
    clock = ManualClock()
    deadlines = Deadlines(clock)
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(deadlines.wait(loop.create_future(), clock.monotonic() + 1.0))
    second = asyncio.create_task(deadlines.wait(loop.create_future(), clock.monotonic() + 2.0))
    await clock.advance(0.5)
    first.cancel()
    await clock.advance(1.0)
    assert first.cancelled()
    assert not second.done()
    await clock.advance(0.5)
    assert second.result() is False


async def test_deadlines_expire_fails_a_future_at_its_deadline_unless_it_is_done() -> None:
    """``expire``: the future gets the error at its deadline; one done before keeps its result."""
    clock = ManualClock()
    deadlines = Deadlines(clock)
    loop = asyncio.get_running_loop()
    late: asyncio.Future[int] = loop.create_future()
    early: asyncio.Future[int] = loop.create_future()
    deadlines.expire(late, clock.monotonic() + 1.0, lambda: TimeoutError("late"))
    deadlines.expire(early, clock.monotonic() + 1.0, lambda: TimeoutError("early"))
    await clock.advance(0.5)
    early.set_result(3)
    await clock.advance(0.499)
    assert not late.done()
    await clock.advance(0.001)
    with pytest.raises(TimeoutError, match="late"):
        late.result()
    assert early.result() == 3
    past: asyncio.Future[int] = loop.create_future()
    deadlines.expire(past, clock.monotonic(), lambda: TimeoutError("past"))
    with pytest.raises(TimeoutError, match="past"):
        past.result()


async def test_deadlines_leave_no_task_once_nothing_is_waited_on() -> None:
    """The sleeping task ends when the last wait is over, long before the deadlines it was sleeping for."""
    clock = ManualClock()
    deadlines = Deadlines(clock)
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[int]] = [loop.create_future() for _ in range(3)]
    waiting = asyncio.create_task(deadlines.wait(futures[0], clock.monotonic() + 5.0))
    deadlines.expire(futures[1], clock.monotonic() + 2.0, lambda: TimeoutError("late"))
    deadlines.expire(futures[2], clock.monotonic() + 3.0, lambda: TimeoutError("late"))
    await clock.advance(0.1)
    assert any(task.get_name() == "deadlines" for task in asyncio.all_tasks())
    for n, future in enumerate(futures):
        future.set_result(n)
    await clock.advance(0.1)
    assert waiting.result() is True
    assert not any(task.get_name() == "deadlines" for task in asyncio.all_tasks())


async def test_a_burst_of_expiries_starts_one_sleeper_and_each_still_fails_on_time() -> None:
    """64 requests arriving in one turn of the loop (NATS hands them over together): one sleeping task, not 64.

    Before the fix each push found the new sleeper not yet asleep (``_wake_at`` unset) and replaced it: a task
    made and cancelled per request on the request_id path. Deadlines out of order still fail each on time.
    """
    clock = ManualClock()
    deadlines = Deadlines(clock)
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[int]] = [loop.create_future() for _ in range(64)]
    offsets = [1.0 + (i % 8) / 8 for i in range(63)] + [0.5]  # the last one earliest: a restart, rightly
    for future, offset in zip(futures, offsets, strict=True):
        deadlines.expire(future, clock.monotonic() + offset, lambda: TimeoutError("late"))
    sleepers = [t for t in asyncio.all_tasks() if t.get_name() == "deadlines"]
    assert len(sleepers) <= 2  # the first, and the one the earlier deadline put in its place
    await clock.advance(0.5)
    assert futures[-1].done()
    assert not any(f.done() for f in futures[:-1])
    await clock.advance(0.5)
    assert [f.done() for f in futures[:-1]] == [i % 8 == 0 for i in range(63)]
    await clock.advance(1.0)
    assert all(isinstance(f.exception(), TimeoutError) for f in futures)
