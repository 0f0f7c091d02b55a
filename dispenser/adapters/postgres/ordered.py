"""Ordered tags' leases in PostgreSQL: ``dispenser_tag_ordered`` (schema version 9; docs/ordered.md).

A tag with a row is ordered, and the row is its owner's lease: taken by a conditional ``UPDATE`` once
``expires_at`` has passed (by the database's clock: the only clock that decides an expiry), renewed by its
holder while unexpired, given up on a clean stop. Each take raises ``epoch``: the fence a fetch checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import BadRequest, UnknownTag
from dispenser.core.lease import MIN_TTL

__all__ = ["MAX_TTL", "OrderedRow", "PostgresLeases", "set_ordered"]

MAX_TTL = 600.0
"""The longest lease the table accepts (its CHECK)."""

_EXPIRY = "clock_timestamp() + make_interval(secs => lease_ttl)"

_LIST = """
SELECT biz_tag, lease_ttl, holder, epoch, expires_at > clock_timestamp() AS held FROM dispenser_tag_ordered
"""
_TAKE = f"""
UPDATE dispenser_tag_ordered SET holder = $2, epoch = epoch + 1, expires_at = {_EXPIRY}
 WHERE biz_tag = $1 AND expires_at <= clock_timestamp()
RETURNING epoch, lease_ttl
"""
_RENEW = f"""
UPDATE dispenser_tag_ordered SET expires_at = {_EXPIRY}
 WHERE biz_tag = $1 AND holder = $2 AND epoch = $3 AND expires_at > clock_timestamp()
RETURNING lease_ttl
"""
_GIVE_UP = """
UPDATE dispenser_tag_ordered SET expires_at = clock_timestamp()
 WHERE biz_tag = $1 AND holder = $2 AND epoch = $3 AND expires_at > clock_timestamp()
RETURNING epoch
"""
_HOLDS = """
SELECT 1 AS held FROM dispenser_tag_ordered
 WHERE biz_tag = $1 AND holder = $2 AND epoch = $3 AND expires_at > clock_timestamp()
"""
_ORDER = """
INSERT INTO dispenser_tag_ordered (biz_tag, lease_ttl)
SELECT biz_tag, $2 FROM leaf_alloc WHERE biz_tag = $1
ON CONFLICT (biz_tag) DO UPDATE SET lease_ttl = EXCLUDED.lease_ttl
RETURNING biz_tag
"""
_UNORDER = """
WITH gone AS (DELETE FROM dispenser_tag_ordered WHERE biz_tag = $1 RETURNING biz_tag)
SELECT biz_tag FROM leaf_alloc WHERE biz_tag = $1
"""


@dataclass(frozen=True, slots=True)
class OrderedRow:
    """An ordered tag's lease as the table has it now."""

    tag: str
    ttl: float
    holder: str | None
    epoch: int
    held: bool
    """Whether the lease is unexpired (by the database's clock)."""


class PostgresLeases:
    """The leases of ordered tags, over the segment store's pool (its error mapping included)."""

    def __init__(self, store: PostgresSegmentStore) -> None:
        """Use ``store``'s pool."""
        self._store = store

    async def ordered(self) -> dict[str, OrderedRow]:
        """Every ordered tag's lease, by tag.

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        rows = await self._store.fetch("reading the ordered tags", _LIST)
        return {
            r["biz_tag"]: OrderedRow(r["biz_tag"], r["lease_ttl"], r["holder"], r["epoch"], r["held"])
            for r in rows
        }

    async def take(self, tag: str, holder: str) -> tuple[int, float] | None:
        """Take ``tag``'s lease if it has expired: its new epoch and ``lease_ttl``; None: still held."""
        row = await self._store.fetchrow(f"taking the lease of ordered tag {tag!r}", _TAKE, tag, holder)
        return None if row is None else (row["epoch"], row["lease_ttl"])

    async def renew(self, tag: str, holder: str, epoch: int) -> float | None:
        """Extend a lease still held: its ``lease_ttl``; None: lost (expired, or the tag is no longer ordered)."""
        row = await self._store.fetchrow(f"renewing the lease of {tag!r}", _RENEW, tag, holder, epoch)
        return None if row is None else float(row["lease_ttl"])

    async def give_up(self, tag: str, holder: str, epoch: int) -> bool:
        """End a lease now (its holder answers no more), so that the next holder need not wait for it."""
        row = await self._store.fetchrow(f"giving up the lease of {tag!r}", _GIVE_UP, tag, holder, epoch)
        return row is not None

    async def holds(self, tag: str, holder: str, epoch: int) -> bool:
        """Whether ``holder`` still holds ``tag``'s lease of ``epoch`` (the fence after a fetch)."""
        row = await self._store.fetchrow(f"checking the lease of {tag!r}", _HOLDS, tag, holder, epoch)
        return row is not None


async def set_ordered(store: PostgresSegmentStore, tag: str, ttl: float | None) -> None:
    """Make ``tag`` ordered with a lease of ``ttl`` seconds, or (None) a plain tag again.

    Raises:
        UnknownTag: no such tag.
        BadRequest: ``ttl`` out of range.
    """
    if ttl is None:
        row = await store.fetchrow(f"making {tag!r} a plain tag", _UNORDER, tag)
    else:
        if not MIN_TTL <= ttl <= MAX_TTL:
            raise BadRequest(f"--lease must be between {MIN_TTL} and {MAX_TTL:g} seconds, not {ttl:g}")
        row = await store.fetchrow(f"making {tag!r} an ordered tag", _ORDER, tag, ttl)
    if row is None:
        raise UnknownTag(tag)
