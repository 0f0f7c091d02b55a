"""The tag table's administration (``leaf_alloc``): list, add, change the step, remove; daily tags' day rows."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import asyncpg

from dispenser.core.daily import DailyPolicy, parse_day_tag
from dispenser.core.errors import BadRequest, TagExists, TagStartTooLow
from dispenser.core.residue import LEAF, Residue
from dispenser.core.store_rules import check_mark
from dispenser.ports import TagInfo

if TYPE_CHECKING:
    from dispenser.adapters.postgres.pool import Pooled

__all__ = ["add_tag", "list_tags", "open_day", "remove_tag", "set_daily", "set_permuted", "set_step"]

# update_time::timestamptz: a table carried over from Leaf may use ``timestamp`` (no zone); the cast is a
# no-op on our own column and makes every TagInfo carry an aware datetime.
_COLUMNS = "biz_tag, max_id, step, COALESCE(description, '') AS description, update_time::timestamptz"

# COLLATE "C": code point order, the same as Python's sorted(), whatever the database's locale.
_LIST_TAGS = f'SELECT {_COLUMNS} FROM leaf_alloc ORDER BY biz_tag COLLATE "C"'

# Schema version 7: each tag with its daily policy, if any; the day rows ('<tag>@YYYYMMDD', a name no valid
# tag has) are a daily tag's counters, not tags, and stay unlisted even once their tag is removed.
_DAY_ROW = "'@[0-9]{8}$'"
_LIST_TAGS_DAILY = f"""
SELECT {_COLUMNS}, d.width, d.time_zone
  FROM leaf_alloc LEFT JOIN dispenser_tag_daily d USING (biz_tag)
 WHERE biz_tag !~ {_DAY_ROW}
 ORDER BY biz_tag COLLATE "C"
"""
# Schema version 10: each tag's permuted mark too (docs/permuted.md).
_LIST_TAGS_PERMUTED = f"""
SELECT {_COLUMNS}, d.width, d.time_zone, p.biz_tag IS NOT NULL AS permuted
  FROM leaf_alloc LEFT JOIN dispenser_tag_daily d USING (biz_tag)
       LEFT JOIN dispenser_tag_permuted p USING (biz_tag)
 WHERE biz_tag !~ {_DAY_ROW}
 ORDER BY biz_tag COLLATE "C"
"""
# One tag with its policies, its leaf_alloc row locked: a fetch of the tag waits until its mark is written.
_LOCK_TAG_PERMUTED = f"""
SELECT {_COLUMNS}, d.width, d.time_zone, p.biz_tag IS NOT NULL AS permuted
  FROM leaf_alloc LEFT JOIN dispenser_tag_daily d USING (biz_tag)
       LEFT JOIN dispenser_tag_permuted p USING (biz_tag)
 WHERE biz_tag = $1
   FOR UPDATE OF leaf_alloc
"""
_FORGET_PERMUTED = "DELETE FROM dispenser_tag_permuted WHERE biz_tag = $1"
_SET_PERMUTED = "INSERT INTO dispenser_tag_permuted (biz_tag) VALUES ($1) ON CONFLICT (biz_tag) DO NOTHING"
_SET_DAILY = """
INSERT INTO dispenser_tag_daily (biz_tag, width, time_zone) VALUES ($1, $2, $3)
ON CONFLICT (biz_tag) DO UPDATE SET width = EXCLUDED.width, time_zone = EXCLUDED.time_zone
"""
_FORGET_DAILY = "DELETE FROM dispenser_tag_daily WHERE biz_tag = $1"
_UPDATE_DAILY = (
    "UPDATE dispenser_tag_daily SET width = $2, time_zone = $3 WHERE biz_tag = $1 RETURNING biz_tag"
)
_DAILY_STEP = f"""
UPDATE leaf_alloc SET step = $2
 WHERE left(biz_tag, length($1::text) + 1) = $1::text || '@' AND biz_tag ~ {_DAY_ROW}
   AND EXISTS (SELECT 1 FROM dispenser_tag_daily WHERE biz_tag = $1::text)
"""
# A day row on its first fetch: at 1, or at the high water of a removed row of that name (its counters were
# handed out), with the daily tag's step. ON CONFLICT: the worker that comes second inserts nothing.
_OPEN_DAY = """
INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
SELECT $1::varchar, GREATEST(1, (SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = $1::varchar)), a.step,
       left('day counter of daily tag ' || a.biz_tag, 256), now()
  FROM leaf_alloc a JOIN dispenser_tag_daily d ON d.biz_tag = a.biz_tag
 WHERE a.biz_tag = $2::varchar
ON CONFLICT (biz_tag) DO NOTHING
"""

_ADD_TAG = f"""
INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
VALUES ($1, $2, $3, $4, now())
RETURNING {_COLUMNS}
"""

_GET_TAG = f"SELECT {_COLUMNS} FROM leaf_alloc WHERE biz_tag = $1"

_SET_STEP = f"UPDATE leaf_alloc SET step = $2, update_time = now() WHERE biz_tag = $1 RETURNING {_COLUMNS}"

_REMOVE_TAG = "DELETE FROM leaf_alloc WHERE biz_tag = $1 RETURNING biz_tag"

# Schema version 5: a tag's residue class (docs/datacenters.md); no row is Leaf's stride 1, offset 0.
_SET_RESIDUE = """
INSERT INTO dispenser_tag_residue (biz_tag, stride, "offset") VALUES ($1, $2, $3)
ON CONFLICT (biz_tag) DO UPDATE SET stride = EXCLUDED.stride, "offset" = EXCLUDED."offset"
"""
_FORGET_RESIDUE = "DELETE FROM dispenser_tag_residue WHERE biz_tag = $1"

# Kept by a trigger on leaf_alloc (schema version 4): the highest max_id of each tag that was removed.
_HIGH_WATER = "SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = $1"


async def list_tags(conn: Pooled) -> list[TagInfo]:
    """All tags ordered by name (code point order), daily ones with their policy, without day rows."""
    try:
        rows = await conn.fetch(_LIST_TAGS_PERMUTED)
    except asyncpg.UndefinedTableError:  # before version 10: no tag is permuted
        try:
            rows = await conn.fetch(_LIST_TAGS_DAILY)
        except asyncpg.UndefinedTableError:  # before version 7: no tag is daily
            rows = await conn.fetch(_LIST_TAGS)
    return [_tag_info(row) for row in rows]


async def open_day(conn: Pooled, name: str) -> bool:
    """Create the day row ``name`` (``<tag>@YYYYMMDD``) of a daily tag if it is missing.

    Returns:
        False when ``name`` is no day row of a daily tag (no such daily tag, or a schema before version 7).
    """
    day_row = parse_day_tag(name)
    if day_row is None:
        return False
    try:
        await conn.execute(_OPEN_DAY, name, day_row[0])
    except asyncpg.UndefinedTableError:
        return False
    return True


async def add_tag(
    conn: Pooled,
    tag: str,
    step: int,
    start: int,
    description: str,
    *,
    residue: Residue = LEAF,
    daily: DailyPolicy | None = None,
    permuted: bool = False,
) -> TagInfo:
    """Insert a tag whose first segment starts at ``start`` (checked by the caller), of ``residue``'s class.

    ``permuted``: marked permuted in the same transaction (docs/permuted.md).

    Raises:
        TagExists: the tag is already there.
        TagStartTooLow: the tag was removed, and ``start`` is below the IDs it handed out.
        BadRequest: a strided tag on a schema before version 5, a daily tag before version 7, a permuted
            tag before version 10.
    """
    if permuted:
        async with conn.transaction():  # never a permuted tag served plain
            info = await add_tag(conn, tag, step, start, description, residue=residue, daily=daily)
            try:
                await conn.execute(_SET_PERMUTED, tag)
            except asyncpg.UndefinedTableError:
                raise BadRequest(
                    "the database's schema predates permuted tags (version 10): run `dispenser migrate` first"
                ) from None
        return dataclasses.replace(info, permuted=True)
    if daily is not None:
        return await _add_daily(conn, tag, step, description, daily)
    if residue.plain:
        info = await _add_row(conn, tag, step, start, description)
        with contextlib.suppress(asyncpg.UndefinedTableError):  # before version 5: no strided tag exists
            await conn.execute(_FORGET_RESIDUE, tag)  # a stale row (the tag removed by Leaf's tools)
        with contextlib.suppress(asyncpg.UndefinedTableError):  # before version 7: no daily tag exists
            await conn.execute(_FORGET_DAILY, tag)
        return info
    async with conn.transaction():  # the row and its class together: never a strided tag served as Leaf's
        info = await _add_row(conn, tag, step, start, description)
        try:
            await conn.execute(_SET_RESIDUE, tag, residue.stride, residue.offset)
        except asyncpg.UndefinedTableError:
            raise BadRequest(
                "the database's schema predates strided tags (version 5): run `dispenser migrate` first"
            ) from None
    return info


async def _add_daily(conn: Pooled, tag: str, step: int, description: str, daily: DailyPolicy) -> TagInfo:
    """A daily tag: its row (whose ``max_id`` no fetch uses) and its policy, together."""
    async with conn.transaction():  # never a daily tag served as a plain one
        info = await _add_row(conn, tag, step, 1, description)
        try:
            await conn.execute(_SET_DAILY, tag, daily.width, daily.time_zone)
        except asyncpg.UndefinedTableError:
            raise BadRequest(
                "the database's schema predates daily tags (version 7): run `dispenser migrate` first"
            ) from None
    return TagInfo(info.tag, info.max_id, info.step, info.description, info.update_time, daily)


async def _add_row(conn: Pooled, tag: str, step: int, start: int, description: str) -> TagInfo:
    try:
        high_water: int | None = await conn.fetchval(_HIGH_WATER, tag)
    except asyncpg.UndefinedTableError:  # schema before version 4: no tombstones kept yet
        high_water = None
    if high_water is not None and start < high_water:
        raise TagStartTooLow(tag, start, high_water)
    try:
        # A savepoint inside a strided add's transaction: a refused INSERT would abort it, and the high water
        # could not be read again below (the fleet model found a retryable store_unavailable there).
        async with conn.transaction():
            row = await conn.fetchrow(_ADD_TAG, tag, start, step, description)
    except asyncpg.UniqueViolationError:
        raise TagExists(tag) from None
    except asyncpg.CheckViolationError:  # removed meanwhile (the trigger's check): read its high water again
        high_water = await conn.fetchval(_HIGH_WATER, tag)
        raise TagStartTooLow(tag, start, high_water or start + 1) from None
    assert row is not None  # INSERT … RETURNING returns the row it inserted
    return _tag_info(row)


async def set_step(conn: Pooled, tag: str, step: int) -> TagInfo | None:
    """Change a tag's configured step, and its day rows' if it is daily; None when there is no such tag."""
    row = await conn.fetchrow(_SET_STEP, tag, step)
    with contextlib.suppress(asyncpg.UndefinedTableError):  # before version 7: no daily tag exists
        await conn.execute(_DAILY_STEP, tag, step)
    return None if row is None else _tag_info(row)


async def set_daily(conn: Pooled, tag: str, daily: DailyPolicy) -> TagInfo | None:
    """Change a daily tag's policy; None when there is no such tag.

    Raises:
        BadRequest: the tag is not daily (or the schema predates daily tags).
    """
    try:
        updated = await conn.fetchval(_UPDATE_DAILY, tag, daily.width, daily.time_zone)
    except asyncpg.UndefinedTableError:
        updated = None
    row = await conn.fetchrow(_GET_TAG, tag)
    if row is None or parse_day_tag(tag) is not None:  # a day row is a counter, not a tag
        return None
    if updated is None:
        raise BadRequest(
            f"tag {tag!r} is not a daily tag: its IDs could meet a daily tag's; add a new tag with --daily"
        )
    info = _tag_info(row)
    return TagInfo(info.tag, info.max_id, info.step, info.description, info.update_time, daily)


async def set_permuted(conn: Pooled, tag: str, permuted: bool) -> TagInfo | None:
    """Mark an existing tag permuted, or not (``tag set --permuted|--no-permuted``); None when there is no such tag.

    Raises:
        BadRequest: marking a daily tag or one past ``MAX_MARKED_MAX_ID`` (``store_rules.check_mark``), or a
            schema before version 10.
    """
    if parse_day_tag(tag) is not None:  # a day row is a counter, not a tag
        return None
    async with conn.transaction():
        try:
            row = await conn.fetchrow(_LOCK_TAG_PERMUTED, tag)
        except asyncpg.UndefinedTableError:
            raise BadRequest(
                "the database's schema predates permuted tags (version 10): run `dispenser migrate` first"
            ) from None
        if row is None:
            return None
        if permuted:
            check_mark(tag, row["max_id"], daily=row["width"] is not None)
        await conn.execute(_SET_PERMUTED if permuted else _FORGET_PERMUTED, tag)
    return dataclasses.replace(_tag_info(row), permuted=permuted)


async def remove_tag(conn: Pooled, tag: str) -> bool:
    """Delete a tag's row (and its class, if any); False when there was none."""
    removed = await conn.fetchval(_REMOVE_TAG, tag) is not None
    with contextlib.suppress(asyncpg.UndefinedTableError):  # before version 5: no strided tag exists
        await conn.execute(_FORGET_RESIDUE, tag)
    with contextlib.suppress(asyncpg.UndefinedTableError):  # before version 7: no daily tag exists
        # Its day rows stay: a daily tag of that name added again goes on with their counters.
        await conn.execute(_FORGET_DAILY, tag)
    return removed


def _tag_info(row: asyncpg.Record) -> TagInfo:
    return TagInfo(
        tag=row["biz_tag"],
        max_id=row["max_id"],
        step=row["step"],
        description=row["description"],
        update_time=row["update_time"],
        daily=DailyPolicy(row["width"], row["time_zone"]) if row.get("width") is not None else None,
        permuted=bool(row.get("permuted")),
    )
