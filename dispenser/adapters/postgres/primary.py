"""Which primary a connection reached, and the repair of a new primary from the remembered grants.

Every new connection of the pool is checked first (:class:`PrimaryWatch`, the pool's ``init``): a standby is
refused, and the remembered ``max_id`` of each tag is restored (``GREATEST``) before any fetch, which closes
the hole asynchronous replication leaves and repairs a database restored from a snapshot (docs/ha.md). A
primary not seen before (another timeline, i.e. after a failover) is also held back for the grace, from
every fetch of the pool. Each fetch carries this worker's floor besides (``segments.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeAlias

import asyncpg

from dispenser.adapters.postgres.returns import drop_taken, is_returned_key
from dispenser.core.daily import parse_day_tag
from dispenser.core.errors import StoreUnavailable
from dispenser.ports import Clock, GrantMemory, SystemClock

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

__all__ = ["Checked", "PrimaryWatch", "identity_of"]

Checked: TypeAlias = "asyncpg.Connection[Any] | PoolConnectionProxy[asyncpg.Record]"
"""A new connection (the pool's ``init``) or one lent by the pool."""


def identity_of(system: str, walfile: str) -> str:
    """``<system identifier>/<timeline>`` from ``pg_control_system()`` and ``pg_walfile_name(…)``."""
    return f"{system}/{int(walfile[:8], 16)}"


# Which primary a connection reached: the cluster (system identifier, kept by physical replicas) and its
# timeline (the WAL file name's first 8 hex digits; every promotion starts a new one). pg_walfile_name
# refuses to run during recovery, hence the check first.
_IDENTITY = """
SELECT pg_is_in_recovery() AS standby, current_database() AS database,
       (SELECT system_identifier::text FROM pg_control_system()) AS system,
       CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_walfile_name(pg_current_wal_lsn()) END AS walfile
"""

# Raise each remembered tag back to what this worker was granted; only rows that lost a grant change.
_REPAIR = """
UPDATE leaf_alloc AS a
   SET max_id = r.max_id, update_time = now()
  FROM unnest($1::text[], $2::bigint[]) AS r(tag, max_id)
 WHERE a.biz_tag = r.tag AND a.max_id < r.max_id
RETURNING a.biz_tag, r.max_id
"""

# A daily tag's day row created just before a failover may be lost whole (its INSERT never replicated): no
# UPDATE can raise it, and the next fetch would open it again at 1. So each remembered day row missing here
# is created at what this worker was granted (or a removed row's high water, if higher), before any fetch.
_REOPEN_DAYS = """
INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
SELECT r.tag, GREATEST(r.max_id, (SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = r.tag)),
       COALESCE(a.step, 1), left('day counter of daily tag ' || left(r.tag, length(r.tag) - 9), 256), now()
  FROM unnest($1::text[], $2::bigint[]) AS r(tag, max_id)
  LEFT JOIN leaf_alloc a ON a.biz_tag = left(r.tag, length(r.tag) - 9)
ON CONFLICT (biz_tag) DO NOTHING
RETURNING biz_tag, max_id
"""

log = logging.getLogger(__name__)


async def _drop_taken(conn: Checked, system: str, timeline: str, taken: dict[str, int]) -> None:
    """Delete the returned ranges this worker took that are back (a restore from before the take)."""
    dropped = await drop_taken(conn, taken)
    if dropped:
        shown = ", ".join(f"{r['biz_tag']!r} {r['first_id']}-{r['last_id']}" for r in dropped[:10])
        log.warning(
            "PostgreSQL primary (system %s, timeline %s) holds returned IDs this worker already took and "
            "handed out (restored from a snapshot or a backup?): dropped %s%s, never handed out again",
            system,
            timeline,
            shown,
            f" and {len(dropped) - 10} more" if len(dropped) > 10 else "",
        )


class PrimaryWatch:
    """Checks every new connection: which primary it reached, and restores the grants it lost first.

    Run by the pool on each connection it opens (asyncpg's ``init``), so no statement of this store runs on
    a connection before the check: a standby is refused with a clear message, and every remembered grant
    of the cluster is restored (a failover, a restored snapshot); a primary on a new timeline also starts
    the grace every fetch of the pool waits out (:meth:`hold`). Each fetch carries :meth:`floor` besides.
    """

    def __init__(
        self, where: str, grants: GrantMemory | None, grace: float = 0.0, clock: Clock | None = None
    ) -> None:
        self._where = where
        self.grants = grants
        self.grace = grace
        """Seconds to hold back every fetch from a primary on a new timeline (see :meth:`hold`)."""
        self._clock = clock or SystemClock()
        self._usable_at = 0.0
        self.database: str | None = None
        """The database the DSN names (known once a connection has been made)."""
        self.cluster: str | None = None
        """``<system identifier>/<database>``: what the remembered grants are kept under (one cluster's)."""
        self.primary: str | None = None
        """``<system identifier>/<timeline>`` of the primary last checked (a new connection, a fetch, a heartbeat)."""

    async def on_connect(self, conn: Checked) -> None:
        """Check (and repair) a new connection before the pool hands it out.

        The remembered grants are restored on every new connection, whichever primary it reached: a
        database restored from a snapshot keeps its system identifier and timeline, so only what it holds
        tells (a restore cuts every connection, so each live worker repairs it within a heartbeat).

        Raises:
            StoreUnavailable: the connection reached a standby.
        """
        await self._check(conn, connected=True)

    async def check(self, conn: Checked) -> None:
        """Check the primary a connection in use reaches now, as :meth:`on_connect` does a new one.

        A pooler that keeps the client socket across a failover (PgBouncer in transaction mode) connects
        the same socket to the new primary without a new connection of ours, so :meth:`on_connect` never
        runs: the heartbeat and every fetch call this (or compare the identity the fetch returned) instead.
        Unlike a new connection, one in use is repaired only when it reaches another primary.
        """
        await self._check(conn, connected=False)

    async def hold(self) -> None:
        """Wait until the grace after a new primary has passed: every fetch of the pool waits here first.

        The grace is the pool's (the worker's), not a connection's: before, a fetch on another connection
        than the one that saw the new primary went out at once.
        """
        wait = self._usable_at - self._clock.monotonic()
        if wait > 0:
            await self._clock.sleep(wait)

    def check_memory(self) -> None:
        """Refuse a fetch while the grant memory cannot make a grant durable (a stalled disk).

        Raises:
            StoreUnavailable: a write of the memory has outlasted its bound; nothing was fetched.
        """
        why = None if self.grants is None else self.grants.stalled()
        if why is not None:  # where the grants are kept: the log's (str), not a reply's
            raise StoreUnavailable(why, logged=f"{why} ({self.grants!r})")

    def floor(self, tag: str) -> tuple[int, str] | None:
        """``(max_id, cluster)``: the floor this worker's next fetch of ``tag`` raises the row to, if any."""
        cluster = self.cluster
        if self.grants is None or cluster is None:
            return None
        found = self.grants.floor(cluster, tag)
        return None if found is None else (found, cluster)

    async def _check(self, conn: Checked, *, connected: bool) -> None:
        row = await conn.fetchrow(_IDENTITY)
        assert row is not None
        if row["standby"]:
            advice = "name the primary, or every node of the cluster with target_session_attrs=read-write"
            raise StoreUnavailable(
                f"connected to a standby, which cannot grant segments: {advice} (see docs/ha.md)",
                logged=f"connected to a standby, which cannot grant segments ({self._where}): {advice} "
                "(see docs/ha.md)",
            )
        database: str = row["database"]
        identity = identity_of(row["system"], row["walfile"])
        self.database = database
        self.cluster = cluster = f"{row['system']}/{database}"
        new = identity != self.primary
        if new:
            if self.primary is not None:
                log.info("PostgreSQL primary is now system %s, timeline %s", *identity.split("/"))
                # A failover: every live worker repairs this primary from its memory on its next
                # connection (within a heartbeat); none of ours fetches before they have had the time.
                self._usable_at = self._clock.monotonic() + self.grace
            elif self.grace > 0 and self._unseen_timeline(cluster, identity):
                # This process's first connection, to a primary on a timeline its memory has not seen: a
                # restart or a scale-out during (or after) a failover. Live peers on other hosts may not
                # have repaired it yet, so the same grace as for a failover seen within one run.
                log.info(
                    "PostgreSQL primary (system %s, timeline %s) is on a timeline this worker has not used "
                    "(last: %s): first fetch held back %.1f s (postgres.new_primary_grace) for live peers "
                    "to restore their grants",
                    *identity.split("/"),
                    self.grants.server(cluster) if self.grants is not None else None,
                    self.grace,
                )
                self._usable_at = self._clock.monotonic() + self.grace
            self.primary = identity
        if connected or new:
            await self._repair(conn, cluster, identity)
        await self.hold()

    def _unseen_timeline(self, cluster: str, identity: str) -> bool:
        """Whether ``identity``'s timeline is later than the last one this worker's memory used in ``cluster``.

        With no memory of the cluster at all (a new worker, a state directory without this cluster), only
        timeline 1 is known to be safe: no promotion ever happened there, so no predecessor can have
        granted what this primary lacks. Without a grant memory there is no repair to wait for.
        """
        if self.grants is None:
            return False
        timeline = int(identity.rpartition("/")[2])
        last = self.grants.server(cluster)
        if last is None:
            return timeline > 1
        return timeline > int(last.rpartition("/")[2])

    async def _repair(self, conn: Checked, cluster: str, identity: str) -> None:
        """Raise the rows of ``cluster``'s primary that hold less than was granted there back to it.

        Every grant remembered for this cluster (same system identifier: a failover and a restore keep
        it, a rebuilt or other database has its own) counts, whatever the timeline it was made on: a
        promoted replica, a snapshot or a PITR restored onto an earlier timeline all lose grants alike.
        Grants of another cluster that had a database of the same name are not applied.
        """
        grants = self.grants
        if grants is None:
            return
        last = grants.server(cluster)
        system, timeline = identity.split("/")
        remembered = await grants.remembered(cluster)
        taken = {key: seq for key, seq in remembered.items() if is_returned_key(key)}
        remembered = {tag: max_id for tag, max_id in remembered.items() if tag not in taken}
        if taken:
            await _drop_taken(conn, system, timeline, taken)
        if remembered:
            tags = sorted(remembered)
            days = [tag for tag in tags if parse_day_tag(tag) is not None]
            try:
                if days:  # only daily tags have them, so the schema has dispenser_removed_tag
                    reopened = await conn.fetch(_REOPEN_DAYS, days, [remembered[t] for t in days])
                    if reopened:
                        log.warning(
                            "PostgreSQL primary (system %s, timeline %s) had lost day rows of daily tags "
                            "granted on it: created again at %s before fetching",
                            system,
                            timeline,
                            ", ".join(f"{r['biz_tag']!r} {r['max_id']}" for r in reopened[:10]),
                        )
                raised = await conn.fetch(_REPAIR, tags, [remembered[t] for t in tags])
            except asyncpg.UndefinedTableError:
                return  # nothing to repair before `dispenser migrate`; try again on the next connection
            if raised:
                shown = ", ".join(f"{r['biz_tag']!r} to {r['max_id']}" for r in raised[:10])
                more = f" and {len(raised) - 10} more" if len(raised) > 10 else ""
                if last == identity:
                    log.warning(
                        "PostgreSQL primary (system %s, timeline %s) holds less than this worker was granted "
                        "on it (same system and timeline: restored from a snapshot or a backup?): raised "
                        "max_id of %s%s before fetching",
                        system,
                        timeline,
                        shown,
                        more,
                    )
                else:
                    since = f"timeline {last.partition('/')[2]}" if last else "an earlier timeline"
                    log.warning(
                        "PostgreSQL primary (system %s, timeline %s) had lost segments granted on its "
                        "predecessor (same system, %s; asynchronous replication, or a restored backup?): "
                        "raised max_id of %s%s before fetching",
                        system,
                        timeline,
                        since,
                        shown,
                        more,
                    )
            elif last != identity:
                log.info(
                    "PostgreSQL primary (system %s, timeline %s) is new to this worker and holds every "
                    "segment it remembers granting in this cluster (%d tags)",
                    system,
                    timeline,
                    len(tags),
                )
        await grants.set_server(cluster, identity)

    async def granted(self, tag: str, max_id: int) -> None:
        """Remember a grant (durably, when there is a memory) before its IDs are handed out."""
        if self.grants is not None and self.cluster is not None:
            await self.grants.remember(self.cluster, tag, max_id)
