"""``dispenser import-leaf``: copy Leaf's tags from its MySQL into the dispenser's PostgreSQL, safely above.

Leaf's rows are read (:mod:`dispenser.adapters.mysql.leaf`), the decisions made by
:func:`dispenser.core.leaf_import.plan_import` (where each tag starts and why: see that module and
``docs/migrating-from-leaf.md``), then applied tag by tag through the segment store: a new tag with
``add_tag``, a forced raise with one ``UPDATE … WHERE max_id < start`` (which can never lower a tag, even
against a worker fetching meanwhile). A dry run reads both databases and writes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from dispenser.adapters.mysql.leaf import read_leaf_alloc
from dispenser.adapters.postgres.schema import schema_version
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable, TagExists, TagStartTooLow
from dispenser.core.leaf_import import Action, LeafRow, Planned, description_of, plan_import

__all__ = ["RECENT_FETCH_SECONDS", "ImportReport", "import_leaf"]

RECENT_FETCH_SECONDS = 60
"""A Leaf row changed this recently suggests a Leaf server is still running: the report warns."""

# Never lowers: a worker may have fetched from the tag since we listed it.
_RAISE = """
UPDATE leaf_alloc SET max_id = $2, update_time = now()
 WHERE biz_tag = $1 AND max_id < $2
RETURNING max_id
"""


@dataclass(frozen=True)
class ImportReport:
    """What an import did (or, in a dry run, would do), tag by tag."""

    plans: list[Planned]
    dry_run: bool
    warnings: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Planned]:
        """The tags that make the run fail: refused (below the safe start, no ``force``) or invalid."""
        return [plan for plan in self.plans if plan.failed]

    def lines(self) -> list[str]:
        """One line per tag, then a summary: what ``dispenser import-leaf`` prints."""
        would = "would " if self.dry_run else ""
        out = []
        for plan in self.plans:
            row = plan.row
            leaf = f"Leaf max_id {row.max_id}, step {row.step}"
            if plan.action is Action.CREATE:
                out.append(f"{would}create  {row.tag}: first ID {plan.start}, step {row.step} ({leaf})")
            elif plan.action is Action.RAISE:
                out.append(f"{would}raise   {row.tag}: next ID {plan.current} -> {plan.start} ({leaf})")
            elif plan.action is Action.UNCHANGED:
                out.append(f"unchanged {row.tag}: next ID {plan.current} >= {plan.start} ({leaf})")
            elif plan.action is Action.REFUSED:
                out.append(f"REFUSED {row.tag}: next ID {plan.current} < {plan.start}: {plan.reason}")
            else:
                out.append(f"INVALID {row.tag}: {plan.reason}")
        counts = {action: sum(p.action is action for p in self.plans) for action in Action}
        summary = ", ".join(f"{n} {action.value}" for action, n in counts.items() if n)
        out.append(
            f"{'dry run, nothing written: ' if self.dry_run else ''}{len(self.plans)} tag(s): {summary or 'none'}"
        )
        return out


async def import_leaf(
    mysql_dsn: str,
    postgres_dsn: str,
    *,
    tags: Sequence[str] | None = None,
    margin: int | None = None,
    force: bool = False,
    dry_run: bool = False,
    timeout: float = 10.0,
) -> ImportReport:
    """Copy Leaf's tags into the dispenser's ``leaf_alloc`` so that each starts above what Leaf can have granted.

    Args:
        mysql_dsn: Leaf's database, ``mysql://user:password@host:port/database``.
        postgres_dsn: the dispenser's PostgreSQL (migrated: ``dispenser migrate``).
        tags: only these of Leaf's tags (each must exist there); None for all.
        margin: IDs above Leaf's ``max_id``; None for one largest Leaf segment per tag (see
            :func:`dispenser.core.leaf_import.default_margin`).
        force: raise a tag the dispenser has below the safe start (never lowers one).
        dry_run: decide and report, write nothing.
        timeout: seconds for each database to connect and answer.

    Raises:
        LeafDatabaseError: Leaf's MySQL could not be read (see :mod:`dispenser.adapters.mysql.leaf`).
        StoreUnavailable: the dispenser's PostgreSQL could not be reached, or has no schema yet.
        ValueError: a DSN is malformed, or ``margin`` is negative.
    """
    if margin is not None and margin < 0:
        raise ValueError(f"the margin must be 0 or more, got {margin}")
    rows = await read_leaf_alloc(mysql_dsn, tags=tags, timeout=timeout)
    if await schema_version(postgres_dsn, command_timeout=timeout) == 0:
        raise StoreUnavailable("the dispenser's database has no tables yet: run `dispenser migrate` first")
    async with await PostgresSegmentStore.connect(postgres_dsn, command_timeout=timeout) as store:
        existing = {info.tag: info.max_id for info in await store.list_tags()}
        plans = plan_import(rows, existing, margin=margin, force=force)
        if not dry_run:
            plans = [await _apply(store, plan) for plan in plans]
    return ImportReport(plans, dry_run, _warnings(rows))


async def _apply(store: PostgresSegmentStore, plan: Planned) -> Planned:
    """Write one decision; a tag another process created meanwhile is reported as refused."""
    row = plan.row
    if plan.action is Action.CREATE:
        try:
            await store.add_tag(row.tag, row.step, plan.start, description_of(row))
        except TagExists:
            reason = "created by someone else during the import; run the import again"
            return dataclasses.replace(plan, action=Action.REFUSED, reason=reason)
        except TagStartTooLow as exc:
            # Removed from this database after handing out IDs above Leaf's: start above both.
            await store.add_tag(row.tag, row.step, exc.high_water, description_of(row))
            reason = f"removed here before, with IDs up to {exc.high_water - 1} handed out: starts above them"
            return dataclasses.replace(plan, start=exc.high_water, reason=reason)
    elif plan.action is Action.RAISE:
        await store.fetchrow(f"raising tag {row.tag!r}", _RAISE, row.tag, plan.start)
    return plan


def _warnings(rows: Sequence[LeafRow]) -> list[str]:
    recent = [
        row.tag for row in rows if row.idle_seconds is not None and row.idle_seconds < RECENT_FETCH_SECONDS
    ]
    if not recent:
        return []
    shown = ", ".join(recent[:10]) + (f" and {len(recent) - 10} more" if len(recent) > 10 else "")
    return [
        f"Leaf fetched a segment of {shown} less than {RECENT_FETCH_SECONDS} s ago: is every Leaf server "
        "stopped? (a running one keeps granting from MySQL; see docs/migrating-from-leaf.md)"
    ]
