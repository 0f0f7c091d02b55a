"""The kazoo handler that caps every socket wait and drops a server that has gone silent."""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import kazoo.handlers.threading  # type: ignore[import-untyped]  # kazoo has no type hints

__all__ = ["BoundedHandler"]


_NEVER_SET = threading.Event()
"""Waited on (with a timeout) by :attr:`BoundedHandler.sleep_func`; never set."""


class BoundedHandler(kazoo.handlers.threading.SequentialThreadingHandler):  # type: ignore[misc]  # untyped
    """kazoo's default handler, with every wait on a socket capped, and a silent server dropped.

    kazoo waits for a handshake answer (and for a TCP connect) up to the whole session timeout. ZooKeeper
    accepts connections a moment before it serves, and one that arrives then may be neither answered nor
    closed (measured: a 10 s stall after a restart, long enough for the session to expire). With the cap,
    the attempt times out and kazoo tries again. ``select`` and ``create_connection`` are the handler
    interface (``kazoo.interfaces.IHandler``) that kazoo's connection does all its socket waiting through;
    the ``handler`` argument of ``KazooClient`` is how kazoo lets a user supply one.

    kazoo gives up on a server only when a ping goes unanswered through a quiet stretch, and every request
    it sends counts as a ping: a client that keeps asking (a lease keepalive each second, re-registration
    tries) never has a quiet stretch, so a server that hangs, or a link cut from server to client, went
    unnoticed for 8.5 s of a 6 s session (measured). Here the connection is dropped when the server has
    sent nothing for ``silence_limit`` seconds; a live server answers a ping within that, as kazoo pings
    after a third of the session timeout without sending. kazoo then tries the next server, as after any
    dropped connection.

    Args:
        io_timeout: The cap on one wait, in seconds.
        silence_limit: Seconds without a byte from the server after which the connection is dropped
            (None: kazoo's own detection only).
    """

    # kazoo's reconnect loop sleeps through the handler's sleep_func (its retry must use the same one).
    # time.sleep is clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) on Linux, which libfaketime (the
    # soak's clock faults) answers with EINVAL: the exception killed kazoo's connection thread, and the
    # worker never reconnected. A timed wait on an event that is never set sleeps the same, anywhere.
    sleep_func = staticmethod(_NEVER_SET.wait)

    def __init__(self, io_timeout: float, silence_limit: float | None = None) -> None:
        super().__init__()
        self.io_timeout = io_timeout
        self.silence_limit = silence_limit
        # Only kazoo's connection thread uses these: the socket to the server and when it last spoke.
        self._server: Any = None
        self._heard = 0.0

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
        """Wait like kazoo's ``select``, at most ``io_timeout`` seconds.

        Raises:
            TimeoutError: the server's socket is among those waited on and the server has sent nothing
                for ``silence_limit`` seconds (kazoo takes it, an ``OSError``, for a dropped connection).
        """
        limit = self.io_timeout if timeout is None else min(timeout, self.io_timeout)
        server = self._server
        if server is None or self.silence_limit is None or not any(s is server for s in rlist):
            return super().select(rlist, wlist, xlist, limit)
        now = time.monotonic()
        limit = max(0.0, min(limit, self._heard + self.silence_limit - now))
        ready = super().select(rlist, wlist, xlist, limit)
        now = time.monotonic()
        if any(s is server for s in ready[0]):
            self._heard = now
        elif now - self._heard >= self.silence_limit:
            raise TimeoutError(
                errno.ETIMEDOUT, f"the ZooKeeper server sent nothing for {now - self._heard:.1f} s"
            )
        return ready

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        """Connect like kazoo's ``create_connection``, the timeout capped at ``io_timeout`` seconds."""
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] = min(kwargs["timeout"], self.io_timeout)
        self._server = None
        sock = super().create_connection(*args, **kwargs)
        self._server, self._heard = sock, time.monotonic()
        return sock
