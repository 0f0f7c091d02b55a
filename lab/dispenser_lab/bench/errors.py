"""The one error every benchmark raises when it cannot run (``dispenser bench`` prints it in one line)."""

from __future__ import annotations

__all__ = ["BenchError"]


class BenchError(RuntimeError):
    """The benchmark could not run (a server or responder did not start, a responder went away)."""
