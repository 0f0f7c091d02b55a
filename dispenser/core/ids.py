"""What a generator hands out for one request: IDs as inclusive ranges (the one batch type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["IdBatch", "Kind", "Range"]

Kind = Literal["segment", "snowflake"]
"""The two generators: database segments, or snowflake IDs (time, worker ID, sequence)."""

Range = tuple[int, int]
"""Inclusive ``(first, last)``."""


# Not frozen: one is built for every request on the hot path, and a frozen dataclass costs ~0.7 µs more to
# build (object.__setattr__; measured): read-only by convention, its ranges a tuple.
@dataclass(slots=True)
class IdBatch:
    """The IDs of one request, as inclusive ranges in increasing order (read-only).

    A segment take spans two segments at most; a snowflake take holds one range per millisecond used.
    """

    ranges: tuple[Range, ...]

    @property
    def count(self) -> int:
        """How many IDs the batch holds."""
        return sum(last - first + 1 for first, last in self.ranges)
