"""The tag table's administration (``leaf_alloc``): list, add, change the step, remove."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg

from dispenser.core.errors import TagExists, TagStartTooLow
from dispenser.ports import TagInfo

if TYPE_CHECKING:
    from dispenser.adapters.postgres.pool import Pooled

__all__ = ["add_tag", "list_tags", "remove_tag", "set_step"]

# update_time::timestamptz: a table carried over from Leaf may use ``timestamp`` (no zone); the cast is a
# no-op on our own column and makes every TagInfo carry an aware datetime.
_COLUMNS = "biz_tag, max_id, step, COALESCE(description, '') AS description, update_time::timestamptz"

# COLLATE "C": code point order, the same as Python's sorted(), whatever the database's locale.
_LIST_TAGS = f'SELECT {_COLUMNS} FROM leaf_alloc ORDER BY biz_tag COLLATE "C"'

_ADD_TAG = f"""
INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
VALUES ($1, $2, $3, $4, now())
RETURNING {_COLUMNS}
"""

_SET_STEP = f"UPDATE leaf_alloc SET step = $2, update_time = now() WHERE biz_tag = $1 RETURNING {_COLUMNS}"

_REMOVE_TAG = "DELETE FROM leaf_alloc WHERE biz_tag = $1 RETURNING biz_tag"

# Kept by a trigger on leaf_alloc (schema version 4): the highest max_id of each tag that was removed.
_HIGH_WATER = "SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = $1"


async def list_tags(conn: Pooled) -> list[TagInfo]:
    """All tags ordered by name (code point order)."""
    return [_tag_info(row) for row in await conn.fetch(_LIST_TAGS)]


async def add_tag(conn: Pooled, tag: str, step: int, start: int, description: str) -> TagInfo:
    """Insert a tag whose first segment starts at ``start`` (checked by the caller).

    Raises:
        TagExists: the tag is already there.
        TagStartTooLow: the tag was removed, and ``start`` is below the IDs it handed out.
    """
    try:
        high_water: int | None = await conn.fetchval(_HIGH_WATER, tag)
    except asyncpg.UndefinedTableError:  # schema before version 4: no tombstones kept yet
        high_water = None
    if high_water is not None and start < high_water:
        raise TagStartTooLow(tag, start, high_water)
    try:
        row = await conn.fetchrow(_ADD_TAG, tag, start, step, description)
    except asyncpg.UniqueViolationError:
        raise TagExists(tag) from None
    except asyncpg.CheckViolationError:  # removed meanwhile (the trigger's check): read its high water again
        high_water = await conn.fetchval(_HIGH_WATER, tag)
        raise TagStartTooLow(tag, start, high_water or start + 1) from None
    assert row is not None  # INSERT … RETURNING returns the row it inserted
    return _tag_info(row)


async def set_step(conn: Pooled, tag: str, step: int) -> TagInfo | None:
    """Change a tag's configured step; None when there is no such tag."""
    row = await conn.fetchrow(_SET_STEP, tag, step)
    return None if row is None else _tag_info(row)


async def remove_tag(conn: Pooled, tag: str) -> bool:
    """Delete a tag's row; False when there was none."""
    return await conn.fetchval(_REMOVE_TAG, tag) is not None


def _tag_info(row: asyncpg.Record) -> TagInfo:
    return TagInfo(
        tag=row["biz_tag"],
        max_id=row["max_id"],
        step=row["step"],
        description=row["description"],
        update_time=row["update_time"],
    )
