"""The worker's last warnings and errors, kept in memory for the status page.

A logging handler on the ``dispenser`` logger keeps the last few records at WARNING and above: their time,
level, logger and message (no traceback: the log has it). What the log says is what the page says, so the
log's rules hold for it (no secret ever reaches a log record: ``tests/secret_scan.py``).
"""

from __future__ import annotations

import collections
import logging

import msgspec

__all__ = ["RECENT_ERRORS", "LoggedError", "RecentErrors"]

RECENT_ERRORS = 20
"""Records kept."""
_MESSAGE_CHARS = 500
"""A longer message is cut here (the log has it whole)."""


class LoggedError(msgspec.Struct, kw_only=True):
    """One log record at WARNING or above."""

    at_ms: int
    """When (Unix ms)."""
    level: str
    logger: str
    message: str


class RecentErrors(logging.Handler):
    """Keeps the last ``size`` records at WARNING and above that reach it; :meth:`attach` it for a worker's life.

    Every worker in a process that attaches one sees the whole process's records (a process runs one worker,
    except in tests).
    """

    def __init__(self, size: int = RECENT_ERRORS) -> None:
        super().__init__(logging.WARNING)
        self._records: collections.deque[LoggedError] = collections.deque(maxlen=size)
        self._logger: logging.Logger | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Keep ``record`` (a record whose message cannot be formatted is kept as its format string)."""
        try:
            message = record.getMessage()
        except Exception:  # a bad %-format: the log's own handler reports it; keep what was meant
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message = f"{message} ({type(record.exc_info[1]).__name__})"
        if len(message) > _MESSAGE_CHARS:
            message = message[: _MESSAGE_CHARS - 1] + "…"
        self._records.append(
            LoggedError(
                at_ms=int(record.created * 1000),
                level=record.levelname,
                logger=record.name,
                message=message,
            )
        )

    def lines(self) -> list[LoggedError]:
        """The records kept, newest first."""
        return list(reversed(self._records))

    def attach(self, name: str = "dispenser") -> None:
        """Start keeping the records of logger ``name`` (and its children)."""
        self.detach()
        self._logger = logging.getLogger(name)
        self._logger.addHandler(self)

    def detach(self) -> None:
        """Stop keeping records (what is kept stays)."""
        if self._logger is not None:
            self._logger.removeHandler(self)
            self._logger = None
