"""Hand kazoo's results, settled in its threads, to the event loop.

kazoo is synchronous and runs its own connection thread; its ``*_async`` calls return a result that is
handed to the loop with ``call_soon_threadsafe`` (no thread per call), and its blocking ``start``/``stop``
run in daemon threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["answer", "in_thread"]

T = TypeVar("T")


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the caller gave up (deadline) meanwhile
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def answer(result: Any) -> asyncio.Future[Any]:
    """An asyncio future settled with a kazoo ``IAsyncResult``'s value or exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def done(result: Any) -> None:  # in kazoo's callback thread
        try:
            value, error = result.get_nowait(), None
        except Exception as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle, future, value, error)

    result.rawlink(done)
    return future


def in_thread(work: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run a blocking kazoo call (start, stop) in a daemon thread.

    Not ``asyncio.to_thread``: the default executor's threads are joined at interpreter exit, and ``stop()``
    with the server gone may take up to a session timeout; a daemon thread never holds up exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            value, error = work(), None
        except Exception as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, value, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
