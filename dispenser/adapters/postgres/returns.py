"""Unused IDs returned on a clean stop (schema version 8): the return, the fetch that takes them first, the repair.

A returned range is a row of ``dispenser_returned_range``; a fetch takes the oldest one (lowest ``seq``) if it
lies above the IDs the worker holds, in the statement that would otherwise grant a new segment (one round
trip, one transaction),
and the worker remembers the row's ``seq`` beside its grants, so that a database restored from before that
take cannot hand the range out again (:func:`drop_taken`). Why and what is guaranteed: ``docs/segment.md``
("Unused IDs returned on a clean stop").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from dispenser.adapters.postgres.schema import TAG_LOCK_CLASS

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

__all__ = ["TAKE_OR_GRANT", "drop_taken", "is_returned_key", "return_ranges", "returned_key"]

_KEY_PREFIX = "\x00returned:"
"""Grant memory keys of the highest ``seq`` taken, per tag: a NUL, which no PostgreSQL text (so no tag) holds."""


def returned_key(tag: str) -> str:
    """The grant memory key under which the highest returned-range ``seq`` taken of ``tag`` is remembered."""
    return _KEY_PREFIX + tag


def is_returned_key(key: str) -> bool:
    """Whether a grant memory key is a :func:`returned_key` (else it is a tag's ``max_id``)."""
    return key.startswith(_KEY_PREFIX)


_CLUSTER = "(SELECT system_identifier::text FROM pg_control_system()) || '/' || current_database()"
_STRIDE = "COALESCE((SELECT stride FROM dispenser_tag_residue WHERE biz_tag = $1), 1)"
_OFFSET = 'COALESCE((SELECT "offset" FROM dispenser_tag_residue WHERE biz_tag = $1), 0)'

# The fetch (segments.py's, with returned ranges first). $1 tag, $2 step (NULL: configured), $3 the max_id
# floor and $4 the cluster it and $6 were remembered in, $5 the newest ID the worker holds (-1: none), $6
# the highest seq this worker took (its memory's). Returned ranges are taken in seq order only, fleet-wide:
# the lowest seq is locked (FOR UPDATE: a second fetch waits for it, then finds it gone and grants anew),
# and taken if it lies above $5, else left for a worker holding less. So every row at or below a seq some
# worker took has been taken: one found there again was brought back by a restore, and is dropped (stale),
# never handed out. Only when no row is taken does leaf_alloc move (NOT EXISTS on the DELETE's RETURNING),
# in the same statement. The tag's row is locked first (tag_row), as a remove locks it before its trigger
# deletes the tag's returned rows: the same order, so a fetch and a remove never deadlock. Every CTE runs,
# referenced or not.
TAKE_OR_GRANT = f"""
WITH seq_floor AS (SELECT CASE WHEN {_CLUSTER} = $4::text THEN $6::bigint END AS seq),
tag_row AS (SELECT 1 FROM leaf_alloc WHERE biz_tag = $1 FOR UPDATE),
stale AS (
    DELETE FROM dispenser_returned_range WHERE seq IN (
        SELECT seq FROM dispenser_returned_range
         WHERE biz_tag = $1
           AND (seq <= (SELECT seq FROM seq_floor) OR stride <> {_STRIDE} OR "offset" <> {_OFFSET})
           FOR UPDATE SKIP LOCKED)
    RETURNING seq),
pick AS (
    SELECT seq, first_id FROM dispenser_returned_range
     WHERE EXISTS (SELECT 1 FROM tag_row) AND biz_tag = $1 AND seq > COALESCE((SELECT seq FROM seq_floor), 0)
       AND stride = {_STRIDE} AND "offset" = {_OFFSET}
     ORDER BY seq LIMIT 1 FOR UPDATE),
taken AS (
    DELETE FROM dispenser_returned_range d USING pick
     WHERE d.seq = pick.seq AND pick.first_id > $5::bigint
    RETURNING d.seq, d.first_id, d.last_id),
bumped AS (
    UPDATE leaf_alloc
       SET max_id = GREATEST(max_id, CASE WHEN {_CLUSTER} = $4::text THEN $3::bigint END)
                    + COALESCE($2::int, step)::bigint * {_STRIDE},
           update_time = now()
     WHERE biz_tag = $1 AND NOT EXISTS (SELECT 1 FROM taken)
    RETURNING max_id, step, COALESCE($2::int, step) AS step_used)
SELECT x.max_id, x.step, x.step_used, x.seq, x.first_id, x.last_id,
       {_STRIDE} AS stride, {_OFFSET} AS "offset",
       (SELECT system_identifier::text FROM pg_control_system()) AS system,
       pg_walfile_name(pg_current_wal_lsn()) AS walfile
  FROM (SELECT max_id, step, step_used, NULL::bigint AS seq, NULL::bigint AS first_id, NULL::bigint AS last_id
          FROM bumped
        UNION ALL
        SELECT a.max_id, a.step, NULL::int, t.seq, t.first_id, t.last_id
          FROM taken t JOIN leaf_alloc a ON a.biz_tag = $1) AS x
"""

# The return, in one transaction under the tag's advisory lock (the one a remove takes), so that a remove
# and a return take turns: a remove first leaves its tombstone (and no row), which refuses the ranges; a
# return first has its rows dropped by the remove's trigger. A range is kept only if it can be a grant of
# the tag as it is now: of its class, below its max_id, at or above a removed incarnation's high water.
_RETURN = f"""
WITH tag AS (
    SELECT a.max_id, {_STRIDE} AS stride, {_OFFSET} AS "offset",
           COALESCE((SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = $1), 0) AS removed
      FROM leaf_alloc a WHERE a.biz_tag = $1),
given AS (SELECT * FROM unnest($2::bigint[], $3::bigint[]) AS g(first_id, last_id))
INSERT INTO dispenser_returned_range (biz_tag, first_id, last_id, stride, "offset", worker)
SELECT $1, g.first_id, g.last_id, t.stride, t."offset", $4
  FROM given g, tag t
 WHERE g.first_id <= g.last_id AND g.first_id >= t.removed AND g.last_id < t.max_id
   AND g.first_id % t.stride = t."offset" AND g.last_id % t.stride = t."offset"
 ORDER BY g.first_id
RETURNING (last_id - first_id) / stride + 1 AS count
"""

# A new connection's repair (primary.py): the rows this worker remembers taking, brought back by a restore.
_DROP_TAKEN = """
DELETE FROM dispenser_returned_range AS r
 USING unnest($1::text[], $2::bigint[]) AS f(tag, seq)
 WHERE r.biz_tag = f.tag AND r.seq <= f.seq
RETURNING r.biz_tag, r.first_id, r.last_id
"""


async def return_ranges(
    conn: asyncpg.Connection[Any] | PoolConnectionProxy[asyncpg.Record],
    tag: str,
    ranges: Sequence[tuple[int, int]],
    worker: str,
) -> int:
    """Insert the ranges that can be grants of ``tag`` now, in one transaction; how many IDs were kept."""
    if not ranges:
        return 0
    firsts = [first for first, _ in ranges]
    lasts = [last for _, last in ranges]
    async with conn.transaction():
        # The lock in a statement of its own: the INSERT's snapshot, taken after it, sees a remove that
        # committed while this waited (its tombstone, and no row).
        await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2::text))", TAG_LOCK_CLASS, tag)
        rows = await conn.fetch(_RETURN, tag, firsts, lasts, worker)
    return sum(row["count"] for row in rows)


async def drop_taken(
    conn: asyncpg.Connection[Any] | PoolConnectionProxy[asyncpg.Record], taken: dict[str, int]
) -> list[asyncpg.Record]:
    """Delete the returned ranges this worker remembers taking (``returned_key`` → seq) that are back.

    Returns:
        The rows deleted: ranges a restored database would have handed out a second time.
    """
    tags = sorted(taken)
    try:
        return await conn.fetch(
            _DROP_TAKEN, [t.removeprefix(_KEY_PREFIX) for t in tags], [taken[t] for t in tags]
        )
    except asyncpg.UndefinedTableError:
        return []  # before schema version 8: nothing was ever returned here
