"""The kazoo handler that caps every socket wait, so an unanswered handshake or ping is retried."""

from __future__ import annotations

import threading
from typing import Any

import kazoo.handlers.threading  # type: ignore[import-untyped]  # kazoo has no type hints

__all__ = ["BoundedHandler"]


_NEVER_SET = threading.Event()
"""Waited on (with a timeout) by :attr:`BoundedHandler.sleep_func`; never set."""


class BoundedHandler(kazoo.handlers.threading.SequentialThreadingHandler):  # type: ignore[misc]  # untyped
    """kazoo's default handler, with every wait on a socket capped at ``io_timeout`` seconds.

    kazoo waits for a handshake answer (and for a TCP connect) up to the whole session timeout. ZooKeeper
    accepts connections a moment before it serves, and one that arrives then may be neither answered nor
    closed (measured: a 10 s stall after a restart, long enough for the session to expire). With the cap,
    the attempt times out and kazoo tries again. ``select`` and ``create_connection`` are the handler
    interface (``kazoo.interfaces.IHandler``) that kazoo's connection does all its socket waiting through;
    the ``handler`` argument of ``KazooClient`` is how kazoo lets a user supply one.

    The connection loop also waits here between pings, so an unanswered ping drops the connection after
    ``io_timeout`` (at most; kazoo's own limit is a third of the session timeout).
    """

    # kazoo's reconnect loop sleeps through the handler's sleep_func (its retry must use the same one).
    # time.sleep is clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) on Linux, which libfaketime (the
    # soak's clock faults) answers with EINVAL: the exception killed kazoo's connection thread, and the
    # worker never reconnected. A timed wait on an event that is never set sleeps the same, anywhere.
    sleep_func = staticmethod(_NEVER_SET.wait)

    def __init__(self, io_timeout: float) -> None:
        super().__init__()
        self.io_timeout = io_timeout

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
        """Wait like kazoo's ``select``, at most ``io_timeout`` seconds."""
        limit = self.io_timeout if timeout is None else min(timeout, self.io_timeout)
        return super().select(rlist, wlist, xlist, limit)

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        """Connect like kazoo's ``create_connection``, the timeout capped at ``io_timeout`` seconds."""
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] = min(kwargs["timeout"], self.io_timeout)
        return super().create_connection(*args, **kwargs)
