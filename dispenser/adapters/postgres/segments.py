"""The segment store over PostgreSQL (asyncpg): Leaf's ``leaf_alloc`` table, one round trip per segment.

Around the store, one module per concern: :mod:`~dispenser.adapters.postgres.errors`,
:mod:`~dispenser.adapters.postgres.pool`, :mod:`~dispenser.adapters.postgres.primary`,
:mod:`~dispenser.adapters.postgres.heartbeat`, :mod:`~dispenser.adapters.postgres.tags`,
:mod:`~dispenser.adapters.postgres.peaks` and :mod:`~dispenser.adapters.postgres.replication`. A fetch in
doubt is never handed out, and a new primary is repaired from the remembered grants: ``docs/ha.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import asyncpg

from dispenser.adapters.postgres import peaks as peak_rows
from dispenser.adapters.postgres import tags as tag_rows
from dispenser.adapters.postgres.errors import dsn_secrets, host_count, map_store_errors, misconfigured
from dispenser.adapters.postgres.heartbeat import beat
from dispenser.adapters.postgres.pool import Pooled, lend, open_pool
from dispenser.adapters.postgres.primary import PrimaryWatch, identity_of
from dispenser.adapters.postgres.replication import Replication, read_replication
from dispenser.adapters.postgres.returns import TAKE_OR_GRANT, return_ranges, returned_key
from dispenser.core.daily import DAY_SEPARATOR, DailyPolicy
from dispenser.core.errors import StoreUnavailable, UnknownTag
from dispenser.core.ids import Kind
from dispenser.core.residue import LEAF, Residue, StridedRange
from dispenser.core.segment import Segment
from dispenser.core.store_rules import check_new_tag, check_step, no_room
from dispenser.ports import Allocation, Clock, GrantMemory, TagInfo
from dispenser.redaction import redact

__all__ = ["PostgresSegmentStore"]

# One statement, so one round trip once asyncpg has prepared it on the connection (its statement cache
# keeps it per connection). COALESCE lets the caller ask for a step other than the configured one (the
# adaptive step) without a second query; the step used comes back so the segment bounds are exact. The
# primary's identity comes back too (system identifier, and the WAL file whose first 8 hex digits are the
# timeline), in the same round trip: a pooler that keeps the client socket across a failover (PgBouncer in
# transaction mode) reaches a new primary without a new connection of ours, so the check of every new
# connection (PrimaryWatch.on_connect) never sees it; the fetch does. Measured cost: docs/ha.md.
#
# The floor ($3, issue 29 item 1): the row is first raised to the highest max_id this worker remembers
# granting there, in the same statement, so that no fetch of this worker ever takes a range below one it
# has seen granted, whatever the database went through (a failover, a restored snapshot or backup) and
# without any identity check. It applies only in the cluster it was remembered in ($4,
# '<system identifier>/<database>'): a pooler that moved the socket to another cluster must not raise that
# one's rows. GREATEST ignores the NULL of "no floor".
_CLUSTER = "(SELECT system_identifier::text FROM pg_control_system()) || '/' || current_database()"
_FLOOR = f"GREATEST(max_id, CASE WHEN {_CLUSTER} = $4::text THEN $3::bigint END)"

_NEXT_SEGMENT = f"""
UPDATE leaf_alloc
   SET max_id = {_FLOOR} + COALESCE($2::int, step), update_time = now()
 WHERE biz_tag = $1
RETURNING max_id, step, COALESCE($2::int, step) AS step_used,
          (SELECT system_identifier::text FROM pg_control_system()) AS system,
          pg_walfile_name(pg_current_wal_lsn()) AS walfile
"""

# The same, for a tag of a residue class (schema version 5, docs/datacenters.md): max_id moves by step x
# stride, still one statement. A tag without a row in dispenser_tag_residue is Leaf's (stride 1, offset 0).
_NEXT_STRIDED_SEGMENT = f"""
WITH r AS (SELECT stride, "offset" FROM dispenser_tag_residue WHERE biz_tag = $1)
UPDATE leaf_alloc
   SET max_id = {_FLOOR} + COALESCE($2::int, step)::bigint * COALESCE((SELECT stride FROM r), 1),
       update_time = now()
 WHERE biz_tag = $1
RETURNING max_id, step, COALESCE($2::int, step) AS step_used,
          COALESCE((SELECT stride FROM r), 1) AS stride, COALESCE((SELECT "offset" FROM r), 0) AS "offset",
          (SELECT system_identifier::text FROM pg_control_system()) AS system,
          pg_walfile_name(pg_current_wal_lsn()) AS walfile
"""

log = logging.getLogger(__name__)


class PostgresSegmentStore:
    """:class:`~dispenser.ports.SegmentStore` over an asyncpg pool.

    Build one with :meth:`connect`. The pool reconnects by itself: after PostgreSQL restarts, or after a
    failover with a multi-host DSN (``target_session_attrs=read-write``), the next call that finds its
    connection closed opens a new one, so the same store object keeps working.
    """

    def __init__(
        self,
        pool: asyncpg.Pool[asyncpg.Record] | None,
        *,
        where: str = "postgres",
        secrets: Sequence[str] = (),
        timeout: float | None = None,
        hosts: int = 1,
        watch: PrimaryWatch | None = None,
        open_pool: Callable[[], Awaitable[asyncpg.Pool[asyncpg.Record]]] | None = None,
    ) -> None:
        """Wrap an existing pool (prefer :meth:`connect`, which builds the pool as this store needs).

        Args:
            pool: the asyncpg pool; the store closes it in :meth:`close`.
            where: how to name the database in messages (a redacted DSN).
            secrets: strings never to repeat in a message.
            timeout: seconds to wait for a pooled connection (opening one if needed).
            hosts: how many hosts the DSN names.
            watch: the pool's connection check (its ``init``), told of every grant.
            open_pool: opens the pool when ``pool`` is None (a lazy start; see :meth:`connect`).
        """
        if pool is None and open_pool is None:
            raise ValueError("a store needs a pool, or the means to open one")
        self._pool = pool
        self._open_pool = open_pool
        self._opening = asyncio.Lock()
        self.start_error: StoreUnavailable | None = None
        """Why PostgreSQL could not be reached at a lazy start (None: it could)."""
        self._where = where
        self._secrets = tuple(secrets)
        self._timeout = timeout
        self._hosts = hosts
        self.watch = watch
        """Which primary the pool last reached, and the remembered grants (None for a bare pool)."""
        self._closed = False
        self._heartbeat: asyncio.Task[None] | None = None
        if watch is not None and watch.grants is not None:
            self._heartbeat = asyncio.create_task(
                beat(self._ready, self._timeout, watch.check), name="postgres-heartbeat"
            )

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 4,
        command_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        application_name: str = "leaf-dispenser",
        grants: GrantMemory | None = None,
        new_primary_grace: float = 0.0,
        lazy: bool = False,
        clock: Clock | None = None,
    ) -> PostgresSegmentStore:
        """Open a pool to ``dsn`` and return a store over it.

        Args:
            dsn: ``postgresql://user:password@host:port/database?sslmode=…`` (asyncpg's syntax; PG*
                environment variables fill in what it leaves out).
            min_size: connections opened now and kept open.
            max_size: most connections open at once (one segment fetch uses one, briefly).
            command_timeout: seconds a statement may take before it is cancelled.
            connect_timeout: seconds to open a connection (at start and when reconnecting).
            application_name: shown in ``pg_stat_activity``.
            grants: remember every grant there, and repair a new primary from it (see the module).
            new_primary_grace: seconds to wait after reaching a primary on a new timeline before using it,
                so that every live worker (each checks its connection every second) has repaired it first.
            lazy: when PostgreSQL cannot be reached now, return the store anyway (its
                :attr:`start_error` says why): every call tries to open the pool again, and raises
                :class:`StoreUnavailable` until it can. A worker then serves, answering ``unavailable``.
            clock: what the new-primary grace is waited on (the real clock by default).

        Raises:
            StoreUnavailable: the first ``min_size`` connections could not be opened (or reached a standby),
                unless ``lazy``.
            ValueError: the DSN or an option is malformed (the message hides the password).
        """
        where = redact(dsn)
        secrets = dsn_secrets(dsn)
        hosts = host_count(dsn)
        watch = PrimaryWatch(where, grants, new_primary_grace, clock)

        async def open_dsn() -> asyncpg.Pool[asyncpg.Record]:
            return await open_pool(
                dsn,
                where=where,
                secrets=secrets,
                hosts=hosts,
                min_size=min_size,
                max_size=max_size,
                command_timeout=command_timeout,
                connect_timeout=connect_timeout,
                application_name=application_name,
                init=watch.on_connect,
            )

        pool: asyncpg.Pool[asyncpg.Record] | None = None
        error: StoreUnavailable | None = None
        try:
            pool = await open_dsn()
        except StoreUnavailable as exc:
            if not lazy or misconfigured(exc):
                raise
            error = exc
        store = cls(
            pool,
            where=where,
            secrets=secrets,
            timeout=connect_timeout + command_timeout,
            hosts=hosts,
            watch=watch,
            open_pool=open_dsn,
        )
        store.start_error = error
        return store

    def __repr__(self) -> str:
        return f"PostgresSegmentStore({self._where})"

    @property
    def connected(self) -> bool:
        """Whether the pool is open (false after a lazy start, until PostgreSQL could be reached)."""
        return self._pool is not None

    async def _ready(self) -> asyncpg.Pool[asyncpg.Record]:
        """The pool, opening it first after a lazy start (one attempt at a time).

        Raises:
            StoreUnavailable: it cannot be opened yet.
        """
        pool = self._pool
        if pool is not None:
            return pool
        async with self._opening:
            if self._pool is None:
                if self._closed:
                    raise StoreUnavailable(
                        "the store is closed", logged=f"the store is closed ({self._where})"
                    )
                assert self._open_pool is not None
                self._pool = await self._open_pool()
                log.info("connected to PostgreSQL at %s", self._where)
            return self._pool

    def _errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return map_store_errors(
            action, where=self._where, secrets=self._secrets, timeout=self._timeout, hosts=self._hosts
        )

    async def next_segment(self, tag: str, step: int | None = None, *, above: int = -1) -> Allocation:
        """Reserve the next segment of ``tag`` in one ``UPDATE … RETURNING`` round trip.

        A range returned unused above ``above`` is taken first, in the same statement (``returns.py``).

        Args:
            tag: the business tag (not validated: a tag carried over from Leaf may use other characters).
            step: the segment size; ``None`` uses the tag's configured step.
            above: the newest ID the caller holds (-1: none); a returned range must lie above it.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time, or the grant could
                not be remembered in the state directory within its bound (a stalled disk; the segment is
                skipped, never handed out).
            BadRequest: ``step`` is below 1 or above the ``step`` column's range.
        """
        if step is not None:
            check_step(step)
        watch = self.watch
        if watch is not None:
            watch.check_memory()  # a stalled state directory: fail before granting (no segment burnt)
        with self._errors(f"fetching the next segment of {tag!r}"):
            try:
                if watch is not None:
                    await watch.hold()  # the new-primary grace holds every connection of the pool
                async with lend(await self._ready(), self._timeout) as conn:
                    # What this fetch expects to reach, taken before it is sent: a fetch that went out
                    # while another one was finding a new primary must be checked too.
                    expected = None if watch is None else watch.primary
                    row = await self._fetch_segment(conn, tag, step, watch, above)
                    if row is not None and watch is not None and expected is not None:
                        reached = identity_of(row["system"], row["walfile"])
                        if reached != expected:
                            # A primary this worker has not checked, reached on a connection it already
                            # had (a pooler kept the socket across a failover): the range just granted
                            # may repeat one its predecessor granted and lost. Skip it (a gap), repair
                            # this primary as a new connection would (and wait out the grace), fetch again.
                            log.warning(
                                "PostgreSQL primary changed under an open connection (system %s, timeline "
                                "%s; a pooler?): segment of %r ending at %d skipped, primary repaired first",
                                *reached.split("/"),
                                tag,
                                row["max_id"],
                            )
                            await watch.check(conn)
                            row = await self._fetch_segment(conn, tag, step, watch, above)
            except asyncpg.NumericValueOutOfRangeError:
                raise no_room(tag, step) from None
        if row is None:
            raise UnknownTag(tag)
        seq = row.get("seq")
        if watch is not None:
            await watch.granted(tag, row["max_id"])
            if seq is not None:  # remembered, so that a restored database cannot hand it out again
                await watch.granted(returned_key(tag), seq)
        residue = Residue(row["stride"], row["offset"]) if "stride" in row else LEAF
        if seq is not None:
            log.info(
                "IDs %d-%d of %r, returned unused, are handed out again", row["first_id"], row["last_id"], tag
            )
            returned = StridedRange(row["first_id"], row["last_id"], residue.stride)
            return Allocation(residue.to_ordinals(returned), row["step"], residue)
        if residue.plain:
            return Allocation(Segment.from_max_id(row["max_id"], row["step_used"]), row["step"])
        granted = residue.grant(row["max_id"], row["step_used"])
        return Allocation(residue.to_ordinals(granted), row["step"], residue)

    @staticmethod
    async def _fetch_segment(
        conn: Pooled, tag: str, step: int | None, watch: PrimaryWatch | None, above: int
    ) -> asyncpg.Record | None:
        row = await PostgresSegmentStore._fetch_row(conn, tag, step, watch, above)
        if row is None and DAY_SEPARATOR in tag and await tag_rows.open_day(conn, tag):
            # A daily tag's day row on its first fetch (docs/daily.md): created, by this worker or the
            # one that came first, then granted like any row.
            row = await PostgresSegmentStore._fetch_row(conn, tag, step, watch, above)
        return row

    @staticmethod
    async def _fetch_row(
        conn: Pooled, tag: str, step: int | None, watch: PrimaryWatch | None, above: int
    ) -> asyncpg.Record | None:
        floor = None if watch is None else watch.floor(tag)
        taken = None if watch is None else watch.floor(returned_key(tag))
        max_id, cluster = (None, None) if floor is None else floor
        seq = None if taken is None else taken[0]
        cluster = cluster if taken is None else taken[1]
        try:
            return await conn.fetchrow(TAKE_OR_GRANT, tag, step, max_id, cluster, above, seq)
        except asyncpg.UndefinedTableError:
            pass  # before schema version 8: nothing returned to take; the statement granted nothing
        try:
            return await conn.fetchrow(_NEXT_STRIDED_SEGMENT, tag, step, max_id, cluster)
        except asyncpg.UndefinedTableError:
            # A schema before version 5 (`dispenser migrate` not run yet): no tag has a stride. The statement
            # failed as a whole, so nothing was granted. Not remembered: once migrated, a strided tag may come.
            return await conn.fetchrow(_NEXT_SEGMENT, tag, step, max_id, cluster)

    async def return_unused(self, tag: str, ranges: Sequence[tuple[int, int]], worker: str) -> int:
        """Give back IDs of ``tag`` granted and never handed out, in one transaction (``returns.py``).

        Returns:
            How many IDs were kept for a later fetch (those that cannot be a grant of the tag as it is now,
            a removed incarnation's among them, are dropped).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached, or the schema is before version 8.
        """
        with self._errors(f"returning unused IDs of {tag!r}"):
            async with lend(await self._ready(), self._timeout) as conn:
                return await return_ranges(conn, tag, ranges, worker)

    async def replication(self) -> Replication:
        """Which primary this store reaches and how it replicates.

        Raises:
            StoreUnavailable: PostgreSQL could not be reached (or no primary is among the DSN's hosts).
        """
        with self._errors("reading the replication state"):
            async with lend(await self._ready(), self._timeout) as conn:
                return await read_replication(conn)

    async def list_tags(self) -> list[TagInfo]:
        """All tags ordered by name (code point order).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("listing tags"):
            async with lend(await self._ready(), self._timeout) as conn:
                return await tag_rows.list_tags(conn)

    async def add_tag(
        self,
        tag: str,
        step: int,
        start: int = 1,
        description: str = "",
        *,
        residue: Residue = LEAF,
        daily: DailyPolicy | None = None,
        permuted: bool = False,
    ) -> TagInfo:
        """Create a tag whose first segment starts at ``start`` (stored as Leaf's ``max_id``).

        With a ``residue`` other than Leaf's, the tag hands out only the IDs ``offset`` modulo ``stride``
        (a database per datacenter, docs/datacenters.md), recorded in ``dispenser_tag_residue``. With
        ``daily``, a daily tag (docs/daily.md), recorded in ``dispenser_tag_daily``. With ``permuted``, a
        permuted tag (docs/permuted.md), recorded in ``dispenser_tag_permuted`` in the same transaction.

        Raises:
            TagExists: the tag is already there.
            TagStartTooLow: the tag was removed and ``start`` is below its high water (its IDs would
                come back; see :class:`~dispenser.core.errors.TagStartTooLow`).
            InvalidTag: the name is not valid.
            BadRequest: ``step`` or ``start`` is below 1, or a value does not fit its column.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        check_new_tag(tag, step, start, description, residue=residue, daily=daily)
        with self._errors(f"adding tag {tag!r}"):
            async with lend(await self._ready(), self._timeout) as conn:
                return await tag_rows.add_tag(
                    conn, tag, step, start, description, residue=residue, daily=daily, permuted=permuted
                )

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """Change a tag's configured step; the next segment fetched with ``step=None`` uses it.

        Raises:
            UnknownTag: no such tag.
            BadRequest: ``step`` is out of range.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        check_step(step)
        with self._errors(f"setting the step of {tag!r}"):
            async with lend(await self._ready(), self._timeout) as conn:
                info = await tag_rows.set_step(conn, tag, step)
        if info is None:
            raise UnknownTag(tag)
        return info

    async def set_daily(self, tag: str, daily: DailyPolicy) -> TagInfo:
        """Change a daily tag's width or zone (workers take it in at their next tag refresh).

        Raises:
            UnknownTag: no such tag.
            BadRequest: the tag is not daily.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors(f"setting the daily policy of {tag!r}"):
            async with lend(await self._ready(), self._timeout) as conn:
                info = await tag_rows.set_daily(conn, tag, daily)
        if info is None:
            raise UnknownTag(tag)
        return info

    async def set_permuted(self, tag: str, permuted: bool) -> TagInfo:
        """Mark a tag permuted or plain (docs/permuted.md); workers take it in at their next tag refresh.

        Raises:
            UnknownTag: no such tag.
            BadRequest: marking a daily tag, or one too far up (``store_rules.check_mark``); a schema before
                version 10.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors(f"marking {tag!r} {'permuted' if permuted else 'plain'}"):
            async with lend(await self._ready(), self._timeout) as conn:
                info = await tag_rows.set_permuted(conn, tag, permuted)
        if info is None:
            raise UnknownTag(tag)
        return info

    async def remove_tag(self, tag: str) -> None:
        """Delete a tag's row; its ``max_id`` is kept (``dispenser_removed_tag``), so that a re-add below is refused.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors(f"removing tag {tag!r}"):
            async with lend(await self._ready(), self._timeout) as conn:
                removed = await tag_rows.remove_tag(conn, tag)
        if not removed:
            raise UnknownTag(tag)

    async def fetchrow(self, action: str, query: str, *args: object) -> asyncpg.Record | None:
        """Run one statement of another adapter over this store's pool, with the same error mapping.

        Args:
            action: what is being done, for the error message ("recording the answer to …").
            query: the SQL, with ``$1``… placeholders.
            *args: the placeholders' values.

        Raises:
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
        """
        with self._errors(action):
            async with lend(await self._ready(), self._timeout) as conn:
                return await conn.fetchrow(query, *args)

    async def fetch(self, action: str, query: str, *args: object) -> list[asyncpg.Record]:
        """Like :meth:`fetchrow`, for a statement that returns many rows.

        Raises:
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
        """
        with self._errors(action):
            async with lend(await self._ready(), self._timeout) as conn:
                return await conn.fetch(query, *args)

    async def __aenter__(self) -> PostgresSegmentStore:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def save_peaks(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """Save each tag's fleet peak and when it was last seen (one round trip; the last writer wins).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("saving the rate peaks"):
            async with lend(await self._ready(), self._timeout) as conn:
                await peak_rows.save_peaks(conn, kind, peaks)

    async def load_peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """The saved ``tag → (peak IDs/s, unix seconds seen)`` (empty before schema version 2).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("loading the rate peaks"):
            async with lend(await self._ready(), self._timeout) as conn:
                return await peak_rows.load_peaks(conn, kind)

    async def close(self) -> None:
        """Close the pool's connections (terminating them if PostgreSQL does not answer). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        pool = self._pool
        if pool is None:
            return
        try:
            await asyncio.wait_for(pool.close(), self._timeout)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError):
            # A graceful close needs the server; without it, drop the sockets.
            pool.terminate()
