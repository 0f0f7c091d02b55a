"""What ``dispenser import-leaf`` does with each of Leaf's tags: where it starts, and whether it may.

Pure decisions (no driver, no I/O): the rows read from Leaf's MySQL ``leaf_alloc`` and the dispenser's own
``max_id`` of each tag go in, one :class:`Planned` per tag comes out. The safe start (Leaf's ``max_id``
plus one largest Leaf segment), and why a tag is never lowered: ``docs/migrating-from-leaf.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dispenser.core.errors import BadRequest, InvalidTag
from dispenser.core.store_rules import MAX_DESCRIPTION, MAX_ID, MAX_STEP, check_new_tag

__all__ = [
    "LEAF_MAX_STEP",
    "Action",
    "LeafRow",
    "Planned",
    "default_margin",
    "description_of",
    "plan_import",
]

LEAF_MAX_STEP = 1_000_000
"""``SegmentIDGenImpl.MAX_STEP``: Leaf doubles a busy tag's step up to this, never past it."""


@dataclass(frozen=True, slots=True)
class LeafRow:
    """One row of Leaf's ``leaf_alloc``: ``[max_id - step, max_id)`` was the last segment it granted."""

    tag: str
    max_id: int
    step: int
    description: str = ""
    idle_seconds: int | None = None
    """Seconds since Leaf last changed the row (its ``update_time``), if the table has that column."""


class Action(enum.Enum):
    """What the import does (or, in a dry run, would do) with one tag."""

    CREATE = "create"
    """The dispenser has no such tag: create it at the safe start with Leaf's step."""
    RAISE = "raise"
    """The dispenser's tag is below the safe start and ``force`` was given: raise its ``max_id``."""
    UNCHANGED = "unchanged"
    """The dispenser's tag already starts at or above the safe start (imported before): nothing to do."""
    REFUSED = "refused"
    """The dispenser's tag is below the safe start; without ``force`` it is left alone, and the run fails."""
    INVALID = "invalid"
    """Leaf's row cannot become a dispenser tag (its name, step or ``max_id``); the run fails."""


@dataclass(frozen=True, slots=True)
class Planned:
    """The decision for one tag.

    Attributes:
        row: Leaf's row.
        action: what to do.
        start: the safe start (the dispenser's first ID for the tag); 0 when ``action`` is INVALID.
        current: the dispenser's ``max_id`` of the tag before the import, None if it has none.
        reason: why, in a few words (for INVALID, REFUSED and UNCHANGED).
    """

    row: LeafRow
    action: Action
    start: int
    current: int | None
    reason: str = ""

    @property
    def failed(self) -> bool:
        """Whether this tag makes the run fail (REFUSED or INVALID)."""
        return self.action in (Action.REFUSED, Action.INVALID)


def default_margin(step: int) -> int:
    """IDs added above Leaf's ``max_id``: one segment of the largest size a Leaf server fetches for the tag."""
    return max(step, LEAF_MAX_STEP)


def _check_row(row: LeafRow) -> str:
    """Why ``row`` cannot become a dispenser tag ("" if it can)."""
    try:
        check_new_tag(row.tag, row.step, 1, "")
    except InvalidTag:
        return f"Leaf's tag {row.tag!r} is not a valid dispenser tag name ([A-Za-z0-9_.-]{{1,128}})"
    except BadRequest:
        return f"Leaf's step {row.step} is outside 1..{MAX_STEP}"
    if row.max_id < 1:
        return f"Leaf's max_id {row.max_id} is below 1"
    return ""


def plan_import(
    rows: Iterable[LeafRow],
    existing: Mapping[str, int],
    *,
    margin: int | None = None,
    force: bool = False,
) -> list[Planned]:
    """Decide, for each of Leaf's rows, what the import does.

    Args:
        rows: Leaf's rows (the tags to import).
        existing: the dispenser's ``max_id`` of each tag it already has.
        margin: IDs added above Leaf's ``max_id``; None for :func:`default_margin` of each tag's step.
        force: raise a tag the dispenser has below the safe start instead of refusing it.

    Raises:
        ValueError: ``margin`` is negative.
    """
    if margin is not None and margin < 0:
        raise ValueError(f"the margin must be 0 or more, got {margin}")
    plans = []
    for row in rows:
        problem = _check_row(row)
        current = existing.get(row.tag)
        if problem:
            plans.append(Planned(row, Action.INVALID, 0, current, problem))
            continue
        start = row.max_id + (default_margin(row.step) if margin is None else margin)
        if start > MAX_ID:
            reason = f"the safe start {start} passes the largest ID {MAX_ID}"
            plans.append(Planned(row, Action.INVALID, 0, current, reason))
        elif current is None:
            plans.append(Planned(row, Action.CREATE, start, None))
        elif current >= start:
            plans.append(Planned(row, Action.UNCHANGED, start, current, "already at or above the safe start"))
        elif force:
            plans.append(Planned(row, Action.RAISE, start, current))
        else:
            reason = (
                "the dispenser's tag is below the safe start (Leaf granted more since?); --force raises it"
            )
            plans.append(Planned(row, Action.REFUSED, start, current, reason))
    return plans


def description_of(row: LeafRow) -> str:
    """Leaf's description, cut to what the dispenser's column holds."""
    return row.description[:MAX_DESCRIPTION]
