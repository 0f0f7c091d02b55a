"""What the clients raise: the dispenser's coded error, and its retryable kind for outages."""

from __future__ import annotations

__all__ = ["DispenserUnavailable", "IdRequestError"]


class IdRequestError(Exception):
    """The dispenser answered with an error reply (or, for :class:`DispenserUnavailable`, none came).

    Attributes:
        code: the stable error code (``unknown_tag``, ``unavailable``, …; see the README).
        message: what went wrong, for a person.
        retryable: whether the same request may succeed later.
    """

    def __init__(self, code: str, message: str, retryable: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class DispenserUnavailable(IdRequestError):
    """No IDs for now; the same call may succeed later (``retryable`` is always true).

    Raised by the buffered clients only once the tag's buffer is empty: what the client holds is handed
    out first. Meanwhile the client keeps asking in the background and recovers by itself.

    ``code`` says why: ``unreachable`` (no worker serves the subject, or the connection is down),
    ``timeout`` (a request got no reply in time, or the call's wait ran out), or the workers' own retryable
    code (``unavailable``: their store is down; ``clock_moved_backwards``; …).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message, True)
