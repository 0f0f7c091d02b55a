"""The status page of a worker (``/status``, ``/status.json``), Leaf's ``/cache`` and ``/db`` pages redone.

:mod:`~dispenser.status.snapshot` reads the worker's state into plain data, :mod:`~dispenser.status.page`
renders it in HTML, :mod:`~dispenser.status.errors` keeps the last warnings and errors logged. No driver
here: the HTTP adapter serves what :class:`StatusPage` gives, where it serves ``/metrics``
(``docs/operations.md``, "The status page").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from dispenser.status.errors import LoggedError, RecentErrors
from dispenser.status.page import CONTENT_SECURITY_POLICY, render_page
from dispenser.status.snapshot import ClockCheck, StatusSources, WorkerStatus, worker_status

__all__ = [
    "ClockCheck",
    "LoggedError",
    "RecentErrors",
    "StatusPage",
    "StatusSources",
    "WorkerStatus",
    "errors",
    "page",
    "snapshot",
    "worker_status",
]

_encoder = msgspec.json.Encoder()


class StatusPage:
    """One worker's status page, read anew at each request (what :class:`~dispenser.adapters.http.Operations` serves).

    Args:
        sources: the worker's generators, rates and dispatchers (they exist before its servers start).
        not_ready: why ``/readyz`` says not ready, now.
        cannot_issue: which kinds it cannot issue now, and why.
        clock_check: the last snowflake clock check against the peers (the worker updates it).
        recent_errors: its last warnings and errors.
        snowflake_mode: ``snowflake.mode``.
    """

    content_security_policy = CONTENT_SECURITY_POLICY
    """The page's ``Content-Security-Policy``."""

    def __init__(
        self,
        sources: StatusSources,
        *,
        not_ready: Callable[[], Sequence[str]] = tuple,
        cannot_issue: Callable[[], Sequence[str]] = tuple,
        clock_check: ClockCheck | None = None,
        recent_errors: RecentErrors | None = None,
        snowflake_mode: str = "",
    ) -> None:
        self._sources = sources
        self._not_ready = not_ready
        self._cannot_issue = cannot_issue
        self._clock_check = clock_check
        self._recent_errors = recent_errors
        self._snowflake_mode = snowflake_mode

    def snapshot(self) -> WorkerStatus:
        """The worker's status now."""
        return worker_status(
            self._sources,
            not_ready=self._not_ready(),
            cannot_issue=self._cannot_issue(),
            clock_check=self._clock_check,
            recent_errors=self._recent_errors.lines() if self._recent_errors is not None else (),
            snowflake_mode=self._snowflake_mode,
        )

    def html(self) -> str:
        """The page, now."""
        return render_page(self.snapshot())

    def json(self) -> bytes:
        """The snapshot in JSON, now."""
        return _encoder.encode(self.snapshot())
