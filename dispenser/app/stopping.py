"""Stopping: the signals that end a command, its wind-down budget, and the background tasks a stop cancels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from dispenser.core.errors import DispenserError

__all__ = ["STOP_BUDGET", "Run", "background", "run_until_signal", "stop_on_signal"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def background(stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    """Run ``work`` in a task of its own, cancelled (and awaited) on stop."""
    task = asyncio.create_task(work, name=name)
    stack.push_async_callback(_cancel, task)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


STOP_BUDGET = 8.0
"""Seconds a command has, from SIGTERM or SIGINT, to wind down (a stop that hangs on a silent dependency is
cut short there): within the 10 s every process must stop in, Kubernetes' grace period of 30 s included."""


@contextlib.contextmanager
def stop_on_signal(on_signal: Callable[[], None]) -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT while the block runs, which also calls ``on_signal`` (removed after)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        stop.set()
        on_signal()

    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, signalled)
    try:
        yield stop
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


Run = Callable[[asyncio.Event], Awaitable[None]]
"""The work of a command once started: runs until the stop event is set (then winds down, and returns)."""


async def run_until_signal(
    start: Callable[[contextlib.AsyncExitStack], Awaitable[Run]], *, stop_budget: float = STOP_BUDGET
) -> int:
    """Start a command, run it until SIGTERM or SIGINT, release what it opened; returns the exit status.

    A signal stops the command in every state: while it starts (a dependency still being waited for: the
    start is cancelled, what it opened released, exit status 1) and while it runs. From the first signal,
    the wind-down has ``stop_budget`` seconds; past them (a dependency that hangs on close), or at a
    second signal, it is cut short, said in one line, and the exit status is 1.

    Args:
        start: opens what the command needs, registering each clean-up on the stack it is given (they run
            in reverse order when the command ends, however it ends), and returns the command's work.
            An ``OSError`` or :class:`DispenserError` from it is a start-up failure: logged in one line,
            exit status 1.
        stop_budget: seconds from the signal to the end of the wind-down.
    """
    loop = asyncio.get_running_loop()
    budget = asyncio.timeout(None)

    def signalled() -> None:
        # The first signal starts the budget; a second one (an impatient Ctrl-C) ends it now.
        when = loop.time() + stop_budget if budget.when() is None else loop.time()
        budget.reschedule(when)

    try:
        async with budget:
            with stop_on_signal(signalled) as stop:
                async with contextlib.AsyncExitStack() as stack:
                    starting = asyncio.ensure_future(start(stack))
                    signal_came = asyncio.ensure_future(stop.wait())
                    try:
                        await asyncio.wait({starting, signal_came}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        signal_came.cancel()
                    if not starting.done():
                        starting.cancel()  # releases what it opened (see Worker.start)
                        await asyncio.gather(starting, return_exceptions=True)
                        log.warning("stopped by a signal before the start finished")
                        return 1
                    try:
                        run = starting.result()
                    except (OSError, DispenserError) as exc:
                        log.error("cannot start: %s", exc)  # the stack releases what was opened
                        return 1
                    await run(stop)
                return 0
    except TimeoutError:
        if not budget.expired():
            raise
    log.error(
        "did not stop within %g s of the signal: gave up waiting for the rest of the clean-up", stop_budget
    )
    return 1
