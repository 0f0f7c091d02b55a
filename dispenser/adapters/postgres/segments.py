"""The segment store over PostgreSQL (asyncpg): Leaf's ``leaf_alloc`` table, one round trip per segment.

asyncpg's exceptions (and ``OSError``, which covers timeouts) become :class:`StoreUnavailable` in one place,
:func:`map_store_errors`; the DSN's password never appears in a message, a ``repr`` or a log line.
The schema itself is created by :func:`dispenser.adapters.postgres.schema.migrate`.

High availability (docs/ha.md): the DSN may name every node of a cluster with
``target_session_attrs=read-write``; each new connection goes to whichever node is the primary. A fetch
that fails for any reason is in doubt (the primary may have committed the UPDATE and died before answering):
its range is never handed out, and the allocator fetches again, on the new primary once there is one.
With a :class:`~dispenser.ports.GrantMemory`, every granted ``max_id`` is remembered before the segment is
handed out, and every new connection first checks which primary it reached: one not seen before (another
system identifier or timeline, i.e. after a failover) gets the remembered ``max_id`` of each tag restored
(``GREATEST``) before any fetch, which closes the hole asynchronous replication leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from dispenser.core.errors import DispenserError, StoreUnavailable, TagExists, UnknownTag
from dispenser.core.ids import Kind
from dispenser.core.segment import Segment
from dispenser.core.store_rules import check_new_tag, check_step, no_room
from dispenser.ports import Allocation, GrantMemory, TagInfo
from dispenser.redaction import redact

__all__ = [
    "PostgresSegmentStore",
    "PrimaryWatch",
    "Replication",
    "dsn_secrets",
    "invalid_settings",
    "map_store_errors",
    "scrub",
]

# One statement, so one round trip once asyncpg has prepared it on the connection (its statement cache
# keeps it per connection). COALESCE lets the caller ask for a step other than the configured one (the
# adaptive step) without a second query; the step used comes back so the segment bounds are exact.
_NEXT_SEGMENT = """
UPDATE leaf_alloc
   SET max_id = max_id + COALESCE($2::int, step), update_time = now()
 WHERE biz_tag = $1
RETURNING max_id, step, COALESCE($2::int, step) AS step_used
"""

# update_time::timestamptz: a table carried over from Leaf may use ``timestamp`` (no zone); the cast is a
# no-op on our own column and makes every TagInfo carry an aware datetime.
_COLUMNS = "biz_tag, max_id, step, COALESCE(description, '') AS description, update_time::timestamptz"

# COLLATE "C": code point order, the same as Python's sorted(), whatever the database's locale.
_SAVE_PEAKS = """
INSERT INTO dispenser_rate_peak (biz_tag, kind, peak, peak_at, update_time)
SELECT t, $2, p, to_timestamp(a), now() FROM unnest($1::text[], $3::float8[], $4::float8[]) AS x(t, p, a)
ON CONFLICT (biz_tag, kind) DO UPDATE SET peak = EXCLUDED.peak, peak_at = EXCLUDED.peak_at, update_time = now()
"""
_LOAD_PEAKS = (
    "SELECT biz_tag, peak, extract(epoch FROM peak_at)::float8 AS at FROM dispenser_rate_peak WHERE kind = $1"
)

_LIST_TAGS = f'SELECT {_COLUMNS} FROM leaf_alloc ORDER BY biz_tag COLLATE "C"'

_ADD_TAG = f"""
INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
VALUES ($1, $2, $3, $4, now())
RETURNING {_COLUMNS}
"""

_SET_STEP = f"UPDATE leaf_alloc SET step = $2, update_time = now() WHERE biz_tag = $1 RETURNING {_COLUMNS}"

_REMOVE_TAG = "DELETE FROM leaf_alloc WHERE biz_tag = $1 RETURNING biz_tag"

_REDACTED = "***"

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

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
"""Seconds between the connection checks of a store that remembers grants (see ``PostgresSegmentStore._beat``)."""


class _QuietPoolFloor(logging.Filter):
    """Turns asyncpg's pool tracebacks at WARNING into one line at DEBUG.

    The pool logs a full traceback each time it fails to reopen a connection in the background: during a
    failover, one every few seconds per pool, for an outage the allocator already reports in one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_pool_logger = logging.getLogger("asyncpg.pool")
if not any(isinstance(f, _QuietPoolFloor) for f in _pool_logger.filters):
    _pool_logger.addFilter(_QuietPoolFloor())


def _host_count(dsn: str) -> int:
    with contextlib.suppress(ValueError):
        netloc = urllib.parse.urlsplit(dsn).netloc.rpartition("@")[2]
        return max(1, len([h for h in netloc.split(",") if h]))
    return 1


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """The strings that must never appear in a message: the DSN's passwords, raw and percent-decoded.

    The split follows asyncpg's own parser (first ``@`` of the netloc, first ``:`` of the userinfo), so
    whatever asyncpg would send as the password is what gets hidden; ``sslpassword`` (the client key's
    passphrase) counts too.
    """
    secrets: set[str] = set()
    with contextlib.suppress(ValueError):
        parts = urllib.parse.urlsplit(dsn)
        auth, at, _ = parts.netloc.partition("@")
        if at and ":" in auth:
            raw = auth.partition(":")[2]
            secrets.update((raw, urllib.parse.unquote(raw)))
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if key in ("password", "sslpassword"):
                secrets.add(value)
    # An empty or one-character "password" would blank out half the message and protects nothing.
    return tuple(sorted((s for s in secrets if len(s) > 1), key=len, reverse=True))


def scrub(text: str, secrets: Sequence[str]) -> str:
    """Return ``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    return text


def invalid_settings(exc: ValueError, where: str, secrets: Sequence[str]) -> ValueError:
    """The error for a malformed DSN or option: a ``ValueError`` (no retry can help) without the password.

    asyncpg raises plain ``ValueError`` for some settings, and its text may quote the DSN.
    """
    return ValueError(scrub(f"invalid connection settings ({where}): {exc}", secrets))


def _describe(exc: BaseException, timeout: float | None, hosts: int = 1) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout} s" if timeout is not None else "timed out"
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if hosts > 1 and isinstance(exc, (ConnectionRefusedError, asyncpg.TargetServerAttributeNotMatched)):
        # asyncpg reports the last host's error only, e.g. "connection refused" from a dead old primary
        # while the others answered as standbys: say what it means.
        return f"no primary among the DSN's {hosts} hosts (each is down or a standby; last error {detail})"
    if isinstance(exc, asyncpg.UndefinedTableError):
        detail += " (was the schema migrated? see dispenser.adapters.postgres.schema.migrate)"
    return detail


@contextlib.contextmanager
def map_store_errors(
    action: str,
    *,
    where: str,
    secrets: Sequence[str] = (),
    timeout: float | None = None,
    unavailable: Callable[[str], DispenserError] = StoreUnavailable,
    hosts: int = 1,
) -> Iterator[None]:
    """Turn the driver's exceptions raised inside the block into :class:`StoreUnavailable` (or ``unavailable``).

    Converted: every asyncpg error (server-side ``PostgresError``, client-side ``InterfaceError``, and
    ``InternalClientError``) and ``OSError`` (refused or reset connections, DNS failures, and
    ``TimeoutError``). Our own errors and cancellation pass through untouched.

    Args:
        action: what was being done, for the message ("fetching the next segment of 'order'").
        where: the redacted DSN (see :func:`dispenser.redaction.redact`).
        secrets: strings to blank out of the driver's message (see :func:`dsn_secrets`).
        timeout: the timeout in force, to say how long we waited when one fires.
        unavailable: the error to raise, built from the message (the worker registry raises
            ``CoordinatorUnavailable``).
        hosts: how many hosts the DSN names (a refused connection then means "no primary").
    """
    try:
        yield
    except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError) as exc:
        raw = f"{action} ({where}): {_describe(exc, timeout, max(hosts, _host_count(where)))}"
        message = scrub(raw, secrets)
        if message == raw:
            raise unavailable(message) from exc
        # The driver's message carried the password: suppress the chain so that tracebacks and error
        # reporters (which honour __suppress_context__) never print the original.
        raise unavailable(message) from None


_MISCONFIGURED = (ssl.SSLCertVerificationError, asyncpg.InvalidAuthorizationSpecificationError)
"""Failures that are this worker's settings, not an outage: a certificate its CA does not verify, a wrong
password or a role the server refuses."""


def _misconfigured(error: BaseException) -> bool:
    """Whether ``error`` came from :data:`_MISCONFIGURED`.

    A lazy start waits out an outage (no primary yet, a failover); waiting for a wrong CA or password
    to fix itself would hide the mistake behind a worker that never serves, so those still stop it.
    """
    cause = error.__cause__ or error.__context__
    while cause is not None:
        if isinstance(cause, _MISCONFIGURED):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


async def _keep_session(_conn: asyncpg.Connection[Any]) -> None:
    """Pool reset hook: nothing to undo, so skip asyncpg's default reset query.

    The default runs ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`` on every
    release: a second round trip per segment. This store never changes session state (no SET, LISTEN,
    cursors or session-level advisory locks), and asyncpg still rolls back a transaction left open.
    """


_REPLICATION = """
SELECT host(inet_server_addr()) AS host, inet_server_port() AS port,
       (SELECT system_identifier::text FROM pg_control_system()) AS system,
       pg_walfile_name(pg_current_wal_lsn()) AS walfile,
       current_setting('synchronous_standby_names') AS standby_names,
       current_setting('synchronous_commit') AS synchronous_commit,
       (SELECT count(*) FROM pg_stat_replication) AS standbys,
       (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')) AS sync_standbys
"""


@dataclass(frozen=True, slots=True)
class Replication:
    """How the primary a store reaches replicates (for ``dispenser check``)."""

    primary: str
    """``host:port`` of the primary as it sees itself."""
    system: str
    timeline: int
    standbys: int
    """Standbys streaming from it (``pg_stat_replication``)."""
    sync_standbys: int
    """Of those, how many it waits for (visible to a superuser or ``pg_monitor`` only; else 0)."""
    standby_names: str
    """``synchronous_standby_names``: empty means commits wait for no standby."""
    synchronous_commit: str

    @property
    def synchronous(self) -> bool:
        """Whether a commit waits for a standby to have it."""
        return bool(self.standby_names.strip()) and self.synchronous_commit not in ("off", "local")


class PrimaryWatch:
    """Checks every new connection: which primary it reached, and repairs a new one's lost grants first.

    Run by the pool on each connection it opens (asyncpg's ``init``), so no statement of this store runs on
    a connection before the check: a standby is refused with a clear message, and a primary not seen
    before (system identifier or timeline changed) gets the remembered grants back (see the module).
    """

    def __init__(self, where: str, grants: GrantMemory | None, grace: float = 0.0) -> None:
        self._where = where
        self.grants = grants
        self.grace = grace
        """Seconds to hold back connections to a primary on a new timeline (see :meth:`on_connect`)."""
        self._usable_at = 0.0
        self.database: str | None = None
        """The database the DSN names (known once a connection has been made)."""
        self.primary: str | None = None
        """``<system identifier>/<timeline>`` of the primary the last new connection reached."""

    async def on_connect(self, conn: asyncpg.Connection[Any]) -> None:
        """Check (and repair) a new connection before the pool hands it out.

        Raises:
            StoreUnavailable: the connection reached a standby.
        """
        row = await conn.fetchrow(_IDENTITY)
        assert row is not None
        if row["standby"]:
            raise StoreUnavailable(
                f"connected to a standby, which cannot grant segments ({self._where}): name the primary, "
                "or every node of the cluster with target_session_attrs=read-write (see docs/ha.md)"
            )
        database: str = row["database"]
        identity = f"{row['system']}/{int(row['walfile'][:8], 16)}"
        self.database = database
        loop = asyncio.get_running_loop()
        if identity != self.primary:
            if self.primary is not None:
                log.info("PostgreSQL primary is now system %s, timeline %s", *identity.split("/"))
                # A failover: every live worker repairs this primary from its memory on its next
                # connection (within a heartbeat); none of ours fetches before they have had the time.
                self._usable_at = loop.time() + self.grace
            self.primary = identity
        await self._repair(conn, database, identity)
        wait = self._usable_at - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _repair(self, conn: asyncpg.Connection[Any], database: str, identity: str) -> None:
        grants = self.grants
        if grants is None or grants.server(database) == identity:
            return
        remembered = grants.remembered(database)
        if remembered:
            tags = sorted(remembered)
            try:
                raised = await conn.fetch(_REPAIR, tags, [remembered[t] for t in tags])
            except asyncpg.UndefinedTableError:
                return  # nothing to repair before `dispenser migrate`; try again on the next connection
            if raised:
                shown = ", ".join(f"{r['biz_tag']!r} to {r['max_id']}" for r in raised[:10])
                more = f" and {len(raised) - 10} more" if len(raised) > 10 else ""
                log.warning(
                    "PostgreSQL primary (system %s, timeline %s) is new to this worker and had lost segments "
                    "it granted (asynchronous replication?): raised max_id of %s%s before fetching",
                    *identity.split("/"),
                    shown,
                    more,
                )
            else:
                log.info(
                    "PostgreSQL primary (system %s, timeline %s) is new to this worker and holds every "
                    "segment it remembers granting (%d tags)",
                    *identity.split("/"),
                    len(tags),
                )
        await grants.set_server(database, identity)

    async def granted(self, tag: str, max_id: int) -> None:
        """Remember a grant (durably, when there is a memory) before its IDs are handed out."""
        if self.grants is not None and self.database is not None:
            await self.grants.remember(self.database, tag, max_id)


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
            self._heartbeat = asyncio.create_task(self._beat(), name="postgres-heartbeat")

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

        Raises:
            StoreUnavailable: the first ``min_size`` connections could not be opened (or reached a standby),
                unless ``lazy``.
            ValueError: the DSN or an option is malformed (the message hides the password).
        """
        where = redact(dsn)
        secrets = dsn_secrets(dsn)
        hosts = _host_count(dsn)
        watch = PrimaryWatch(where, grants, new_primary_grace)

        async def open_pool() -> asyncpg.Pool[asyncpg.Record]:
            with map_store_errors(
                "connecting", where=where, secrets=secrets, timeout=connect_timeout, hosts=hosts
            ):
                try:
                    return await asyncpg.create_pool(
                        dsn,
                        min_size=min_size,
                        max_size=max_size,
                        command_timeout=command_timeout,
                        timeout=connect_timeout,
                        reset=_keep_session,
                        init=watch.on_connect,
                        server_settings={"application_name": application_name},
                    )
                except ValueError as exc:
                    if isinstance(exc, OSError):
                        raise  # a TLS failure (e.g. certificate verify failed): unavailable, as at run time
                    raise invalid_settings(exc, where, secrets) from None

        pool: asyncpg.Pool[asyncpg.Record] | None = None
        error: StoreUnavailable | None = None
        try:
            pool = await open_pool()
        except StoreUnavailable as exc:
            if not lazy or _misconfigured(exc):
                raise
            error = exc
        store = cls(
            pool,
            where=where,
            secrets=secrets,
            timeout=connect_timeout + command_timeout,
            hosts=hosts,
            watch=watch,
            open_pool=open_pool,
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
                    raise StoreUnavailable(f"the store is closed ({self._where})")
                assert self._open_pool is not None
                self._pool = await self._open_pool()
                log.info("connected to PostgreSQL at %s", self._where)
            return self._pool

    def _errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return map_store_errors(
            action, where=self._where, secrets=self._secrets, timeout=self._timeout, hosts=self._hosts
        )

    async def next_segment(self, tag: str, step: int | None = None) -> Allocation:
        """Reserve the next segment of ``tag`` in one ``UPDATE … RETURNING`` round trip.

        Args:
            tag: the business tag (not validated: a tag carried over from Leaf may use other characters).
            step: the segment size; ``None`` uses the tag's configured step.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
            BadRequest: ``step`` is below 1 or above the ``step`` column's range.
        """
        if step is not None:
            check_step(step)
        with self._errors(f"fetching the next segment of {tag!r}"):
            try:
                async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                    row = await conn.fetchrow(_NEXT_SEGMENT, tag, step)
            except asyncpg.NumericValueOutOfRangeError:
                raise no_room(tag, step) from None
        if row is None:
            raise UnknownTag(tag)
        if self.watch is not None:
            await self.watch.granted(tag, row["max_id"])
        return Allocation(Segment.from_max_id(row["max_id"], row["step_used"]), row["step"])

    async def replication(self) -> Replication:
        """Which primary this store reaches and how it replicates.

        Raises:
            StoreUnavailable: PostgreSQL could not be reached (or no primary is among the DSN's hosts).
        """
        with self._errors("reading the replication state"):
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                row = await conn.fetchrow(_REPLICATION)
        assert row is not None
        return Replication(
            primary=f"{row['host'] or 'local socket'}:{row['port'] or ''}".rstrip(":"),
            system=row["system"],
            timeline=int(row["walfile"][:8], 16),
            standbys=row["standbys"],
            sync_standbys=row["sync_standbys"],
            standby_names=row["standby_names"],
            synchronous_commit=row["synchronous_commit"],
        )

    async def list_tags(self) -> list[TagInfo]:
        """All tags ordered by name (code point order).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("listing tags"):
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                rows = await conn.fetch(_LIST_TAGS)
        return [_tag_info(row) for row in rows]

    async def add_tag(self, tag: str, step: int, start: int = 1, description: str = "") -> TagInfo:
        """Create a tag whose first segment starts at ``start`` (stored as Leaf's ``max_id``).

        Raises:
            TagExists: the tag is already there.
            InvalidTag: the name is not valid.
            BadRequest: ``step`` or ``start`` is below 1, or a value does not fit its column.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        check_new_tag(tag, step, start, description)
        with self._errors(f"adding tag {tag!r}"):
            try:
                async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                    row = await conn.fetchrow(_ADD_TAG, tag, start, step, description)
            except asyncpg.UniqueViolationError:
                raise TagExists(tag) from None
        assert row is not None  # INSERT … RETURNING returns the row it inserted
        return _tag_info(row)

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """Change a tag's configured step; the next segment fetched with ``step=None`` uses it.

        Raises:
            UnknownTag: no such tag.
            BadRequest: ``step`` is out of range.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        check_step(step)
        with self._errors(f"setting the step of {tag!r}"):
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                row = await conn.fetchrow(_SET_STEP, tag, step)
        if row is None:
            raise UnknownTag(tag)
        return _tag_info(row)

    async def remove_tag(self, tag: str) -> None:
        """Delete a tag's row.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors(f"removing tag {tag!r}"):
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                removed = await conn.fetchval(_REMOVE_TAG, tag)
        if removed is None:
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
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                return await conn.fetchrow(query, *args)

    async def __aenter__(self) -> PostgresSegmentStore:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def save_peaks(self, kind: Kind, peaks: dict[str, tuple[float, float]]) -> None:
        """Save each tag's fleet peak and when it was last seen (one round trip; the last writer wins).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        tags = list(peaks)
        with self._errors("saving the rate peaks"):
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                await conn.execute(
                    _SAVE_PEAKS, tags, kind, [peaks[t][0] for t in tags], [peaks[t][1] for t in tags]
                )

    async def load_peaks(self, kind: Kind) -> dict[str, tuple[float, float]]:
        """The saved ``tag → (peak IDs/s, unix seconds seen)`` (empty before schema version 2).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("loading the rate peaks"):
            async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                try:
                    rows = await conn.fetch(_LOAD_PEAKS, kind)
                except asyncpg.UndefinedTableError:  # not migrated yet: no peaks, not an outage
                    return {}
        return {row["biz_tag"]: (row["peak"], row["at"]) for row in rows}

    async def _beat(self) -> None:
        """Use a connection every second, so that a failover is noticed (and repaired) promptly.

        A worker whose buffers hold IDs may not fetch for minutes; its grants must still be restored on a
        new primary before the other workers fetch there. Errors are not reported here: the allocator
        reports outages, this only gets a new connection opened (and checked) as soon as one can be.
        """
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            with contextlib.suppress(
                DispenserError,
                asyncpg.PostgresError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
                OSError,
            ):
                async with (await self._ready()).acquire(timeout=self._timeout) as conn:
                    await conn.execute("SELECT 1")

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


def _tag_info(row: asyncpg.Record) -> TagInfo:
    return TagInfo(
        tag=row["biz_tag"],
        max_id=row["max_id"],
        step=row["step"],
        description=row["description"],
        update_time=row["update_time"],
    )
