"""Rules every segment store applies before writing a ``leaf_alloc`` row, so the fake and Postgres agree."""

from __future__ import annotations

from dispenser.core.daily import MAX_TAG_LENGTH, DailyPolicy
from dispenser.core.errors import BadRequest, TagExhausted
from dispenser.core.residue import LEAF, Residue
from dispenser.core.tags import validate_tag

__all__ = [
    "MAX_DESCRIPTION",
    "MAX_ID",
    "MAX_MARKED_MAX_ID",
    "MAX_STEP",
    "check_mark",
    "check_new_tag",
    "check_step",
    "no_room",
    "not_daily",
]

MAX_STEP = 2**31 - 1
"""``leaf_alloc.step`` is an ``int`` column (Leaf's ``int(11)``)."""

MAX_ID = 2**63 - 1
"""``leaf_alloc.max_id`` is a ``bigint``."""

MAX_DESCRIPTION = 256
"""``leaf_alloc.description`` is ``varchar(256)``: characters, not bytes."""


MAX_MARKED_MAX_ID = 5 * 10**17
"""The highest ``max_id`` of a tag that may be marked permuted once it exists (``tag set --permuted``).

A permuted ID is at least ``10**18`` (``core.permute.SPAN``, not imported: it loads the cipher) and a plain
counter below it, which is what keeps a tag's plain IDs apart from its permuted ones. A worker that has not
seen the mark yet goes on fetching plain segments until its next tag refresh: half of ``10**18`` left is far
more than any fleet fetches in that time (a step is at most ``2**31 - 1``)."""


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


def check_mark(tag: str, max_id: int, *, daily: bool) -> None:
    """Raise BadRequest unless an existing tag may be marked permuted (docs/permuted.md).

    Refused: a daily tag (its IDs are dates and counters, never permuted), and a tag whose ``max_id`` is
    above :data:`MAX_MARKED_MAX_ID` (its plain IDs could reach the permuted IDs' range).
    """
    if daily:
        raise BadRequest(f"tag {tag!r} is a daily tag: its IDs are dates and counters, never permuted")
    if max_id > MAX_MARKED_MAX_ID:
        raise BadRequest(
            f"tag {tag!r} is at {max_id}, above {MAX_MARKED_MAX_ID}: its plain IDs could reach 10**18, where "
            "permuted IDs begin; add a new tag with --permuted"
        )
