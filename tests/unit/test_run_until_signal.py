"""The command life cycle: start, run until SIGTERM/SIGINT, clean-ups in reverse order whatever fails."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from dispenser.app import Run, run_until_signal
from dispenser.core.errors import StoreUnavailable


async def _start_three(
    stack: contextlib.AsyncExitStack, done: list[str], *, failing: str | None = None
) -> None:
    """Open three parts, each registering its clean-up; the one named ``failing`` raises when closed."""
    for name in ("pool", "connection", "service"):

        async def close(name: str = name) -> None:
            done.append(name)
            if name == failing:
                raise RuntimeError(f"closing {name} failed")

        stack.push_async_callback(close)


async def test_sigterm_stops_the_run_and_every_clean_up_runs_in_reverse() -> None:
    """SIGTERM ends the run; the clean-ups run last-opened first; the exit status is 0."""
    done: list[str] = []

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        await _start_three(stack, done)

        async def run(stop: asyncio.Event) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            await stop.wait()
            done.append("run ended")

        return run

    assert await asyncio.wait_for(run_until_signal(start), 10) == 0
    assert done == ["run ended", "service", "connection", "pool"]


async def test_a_failing_clean_up_does_not_leak_the_later_ones() -> None:
    """The middle clean-up raises: the one after it still runs, and the failure is raised, not swallowed."""
    done: list[str] = []

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        await _start_three(stack, done, failing="connection")

        async def run(stop: asyncio.Event) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            await stop.wait()

        return run

    with pytest.raises(RuntimeError, match="closing connection failed"):
        await asyncio.wait_for(run_until_signal(start), 10)
    assert done == ["service", "connection", "pool"]


async def test_a_failed_start_releases_what_it_opened_and_exits_1(caplog: pytest.LogCaptureFixture) -> None:
    """A start-up error (PostgreSQL unavailable once three parts are open) is one log line and status 1."""
    done: list[str] = []

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        await _start_three(stack, done)
        raise StoreUnavailable("PostgreSQL is down")

    assert await run_until_signal(start) == 1
    assert done == ["service", "connection", "pool"]
    assert "cannot start: segment store unavailable: PostgreSQL is down" in caplog.text


async def test_the_signal_handlers_are_removed_afterwards() -> None:
    """After the command, SIGTERM is no longer routed to its stop event (the loop's handler is gone)."""

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        async def run(stop: asyncio.Event) -> None:
            stop.set()

        return run

    assert await run_until_signal(start) == 0
    loop = asyncio.get_running_loop()
    assert not loop.remove_signal_handler(signal.SIGTERM)
    assert not loop.remove_signal_handler(signal.SIGINT)


async def test_a_signal_during_a_start_that_hangs_stops_it(caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM while the start waits for a dependency that never answers: cancelled, released, status 1.

    Issue 22: ``serve`` ignored SIGTERM while it connected to NATS.
    """
    done: list[str] = []
    waiting = asyncio.Event()

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        await _start_three(stack, done)
        waiting.set()
        await asyncio.Event().wait()  # a dependency that never answers
        raise AssertionError("not reached")

    async def signal_once_waiting() -> None:
        await waiting.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    killer = asyncio.create_task(signal_once_waiting())
    assert await asyncio.wait_for(run_until_signal(start), 10) == 1
    await killer
    assert done == ["service", "connection", "pool"]
    assert "stopped by a signal before the start finished" in caplog.text


async def test_a_wind_down_that_hangs_is_cut_at_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    """A clean-up that hangs after the signal (a silent dependency) is cut short at the stop budget: status 1."""
    done: list[str] = []

    async def start(stack: contextlib.AsyncExitStack) -> Run:
        await _start_three(stack, done)

        async def hang() -> None:
            done.append("hanging")
            await asyncio.Event().wait()

        stack.push_async_callback(hang)

        async def run(stop: asyncio.Event) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            await stop.wait()

        return run

    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.wait_for(run_until_signal(start, stop_budget=0.2), 10) == 1
    assert 0.19 <= loop.time() - started < 5  # uvloop's clock counts whole milliseconds
    assert done[0] == "hanging"
    assert "did not stop within 0.2 s of the signal" in caplog.text
