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
    sent nothing for ``silence_limit`` seconds while something we sent has waited at least half of that
    for an answer; kazoo then tries the next server, as after any dropped connection. A live server is
    heard at least every third of the session timeout (kazoo pings after that long without sending). The
    second condition keeps a starved connection thread, one that wakes late and has not sent its ping
    yet, from taking its own silence for the server's.

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
        # Only kazoo's connection thread uses these: the socket to the server, when it last spoke, and when
        # we first wrote to it after that (None: nothing written since).
        self._server: Any = None
        self._heard = 0.0
        self._waiting_since: float | None = None
        self._address: Any = None
        self._avoid: Any = None
        """The address of a server just dropped for its silence: the next attempt goes to another one."""

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
        """Wait like kazoo's ``select``, at most ``io_timeout`` seconds.

        Raises:
            TimeoutError: the server's socket is among those waited on, the server has sent nothing for
                ``silence_limit`` seconds, and what we wrote first since has waited half that (kazoo takes
                it, an ``OSError``, for a dropped connection).
        """
        limit = self.io_timeout if timeout is None else min(timeout, self.io_timeout)
        server, silence = self._server, self.silence_limit
        if server is None or silence is None:
            return super().select(rlist, wlist, xlist, limit)
        if any(s is server for s in wlist) and self._waiting_since is None:
            self._waiting_since = time.monotonic()  # kazoo is about to write to the server
        if not any(s is server for s in rlist):
            return super().select(rlist, wlist, xlist, limit)
        now = time.monotonic()
        if self._waiting_since is not None:
            due = max(self._heard + silence, self._waiting_since + silence / 2)
            limit = max(0.0, min(limit, due - now))
        ready = super().select(rlist, wlist, xlist, limit)
        now = time.monotonic()
        if any(s is server for s in ready[0]):
            self._heard, self._waiting_since = now, None
        elif (
            self._waiting_since is not None
            and now - self._heard >= silence
            and now - self._waiting_since >= silence / 2
        ):
            self._avoid = self._address
            raise TimeoutError(
                errno.ETIMEDOUT,
                f"the ZooKeeper server sent nothing for {now - self._heard:.1f} s "
                f"({now - self._waiting_since:.1f} s after a request)",
            )
        return ready

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        """Connect like kazoo's ``create_connection``, the timeout capped at ``io_timeout`` seconds.

        Raises:
            ConnectionRefusedError: at once, when asked for the server just dropped for its silence (once:
                kazoo goes on to the next server). Its shuffled list may start with that server again,
                and a silent server accepts the connection and leaves the handshake unanswered for
                seconds (measured: the session moved after 5.1 s instead of 3.0 s).
        """
        address = kwargs.get("address", args[0] if args else None)
        avoid, self._avoid = self._avoid, None
        if avoid is not None and address == avoid:
            raise ConnectionRefusedError(
                errno.ECONNREFUSED,
                f"{address[0]}:{address[1]} was silent a moment ago; trying another server",
            )
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] = min(kwargs["timeout"], self.io_timeout)
        self._server = None
        sock = super().create_connection(*args, **kwargs)
        self._server, self._address, self._heard, self._waiting_since = sock, address, time.monotonic(), None
        return sock
