"""Rules every segment store applies before writing a ``leaf_alloc`` row, so the fake and Postgres agree."""

from __future__ import annotations

from dispenser.core.daily import MAX_TAG_LENGTH, DailyPolicy
from dispenser.core.errors import BadRequest, TagExhausted
from dispenser.core.residue import LEAF, Residue
from dispenser.core.tags import validate_tag

__all__ = ["MAX_DESCRIPTION", "MAX_ID", "MAX_STEP", "check_new_tag", "check_step", "no_room", "not_daily"]

MAX_STEP = 2**31 - 1
"""``leaf_alloc.step`` is an ``int`` column (Leaf's ``int(11)``)."""

MAX_ID = 2**63 - 1
"""``leaf_alloc.max_id`` is a ``bigint``."""

MAX_DESCRIPTION = 256
"""``leaf_alloc.description`` is ``varchar(256)``: characters, not bytes."""


def check_step(step: int) -> None:
    """Raise BadRequest unless ``step`` fits the ``step`` column and grants at least one ID."""
    if not 1 <= step <= MAX_STEP:
        raise BadRequest(f"step must be between 1 and {MAX_STEP}, got {step}")


def check_new_tag(
    tag: str,
    step: int,
    start: int,
    description: str,
    *,
    residue: Residue = LEAF,
    daily: DailyPolicy | None = None,
) -> None:
    """Validate the arguments of ``add_tag``.

    Raises:
        InvalidTag: the name is not valid.
        BadRequest: the step, start or description does not fit the table; a daily tag with a start, a
            class or a name too long for its day rows (docs/daily.md).
    """
    validate_tag(tag)
    if daily is not None:
        if start != 1:
            raise BadRequest("a daily tag's counter starts at 1 every day: it takes no start")
        if not residue.plain:
            raise BadRequest("a daily tag has no stride: each day's counter is one row of one database")
        if len(tag) > MAX_TAG_LENGTH:
            raise BadRequest(
                f"a daily tag's name is at most {MAX_TAG_LENGTH} characters (its day rows add "
                f"'@YYYYMMDD'), got {len(tag)}"
            )
    check_step(step)
    if not 1 <= start <= MAX_ID:
        raise BadRequest(f"start must be between 1 and {MAX_ID}, got {start}")
    if len(description) > MAX_DESCRIPTION:
        raise BadRequest(f"description is {len(description)} characters long; the limit is {MAX_DESCRIPTION}")


def no_room(tag: str, step: int | None) -> TagExhausted:
    """The error for a tag whose ``max_id`` cannot grow by ``step`` without passing ``MAX_ID``."""
    size = "its configured step" if step is None else f"{step} IDs"
    return TagExhausted(
        tag,
        f"tag {tag!r} has no room for a segment of {size}: max_id would pass {MAX_ID}; "
        "a smaller step or a new tag is needed",
    )


def not_daily(tag: str) -> BadRequest:
    """The error for setting a daily policy on a tag that is not daily (docs/daily.md)."""
    return BadRequest(
        f"tag {tag!r} is not a daily tag: its IDs could meet a daily tag's; add a new tag with --daily"
    )
