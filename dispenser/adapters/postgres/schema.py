"""The PostgreSQL schema and its versioned migrations (``dispenser_schema_version`` records what ran).

Migrations are append-only, run in one transaction under an advisory lock, and keep an existing Leaf
``leaf_alloc``: ``docs/segment.md`` ("The table").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import asyncpg

from dispenser.adapters.postgres.errors import dsn_secrets, invalid_settings, map_store_errors
from dispenser.adapters.postgres.hosts import connect_to_primary
from dispenser.core.errors import StoreUnavailable
from dispenser.ports import Clock, SystemClock
from dispenser.redaction import redact
from dispenser.service.retry import Backoff

__all__ = ["LOCK_RETRY_FOR", "LOCK_TIMEOUT", "MIGRATIONS", "Migration", "migrate", "schema_version"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema version: the SQL that brings the previous version to this one."""

    version: int
    description: str
    sql: str


TAG_LOCK_CLASS: Final = 0x6C65_6166
"""First key of the per-tag ``pg_advisory_xact_lock(TAG_LOCK_CLASS, hashtext(biz_tag))`` (the bytes of ``leaf``)."""


def _dropped_with_tag(table: str, name: str) -> str:
    """The SQL that deletes a tag's rows of ``table`` when the tag leaves ``leaf_alloc``.

    DELETE and UPDATE of ``biz_tag`` drop its rows, TRUNCATE drops every row, in the same transaction; the
    function and its triggers are ``dispenser_drop_<name>``, ``dispenser_drop_renamed_<name>`` and
    ``dispenser_drop_truncated_<name>``. The text is part of released migrations: keep it byte for byte.
    """
    function = f"dispenser_drop_{name}"
    return f"""
        CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_LEVEL = 'STATEMENT' THEN
                DELETE FROM {table};
                RETURN NULL;
            END IF;
            DELETE FROM {table} WHERE biz_tag = OLD.biz_tag;
            RETURN NULL;
        END $$;
        DROP TRIGGER IF EXISTS {function} ON leaf_alloc;
        CREATE TRIGGER {function} AFTER DELETE ON leaf_alloc
            FOR EACH ROW EXECUTE FUNCTION {function}();
        DROP TRIGGER IF EXISTS dispenser_drop_renamed_{name} ON leaf_alloc;
        CREATE TRIGGER dispenser_drop_renamed_{name} AFTER UPDATE OF biz_tag ON leaf_alloc
            FOR EACH ROW WHEN (OLD.biz_tag IS DISTINCT FROM NEW.biz_tag)
            EXECUTE FUNCTION {function}();
        DROP TRIGGER IF EXISTS dispenser_drop_truncated_{name} ON leaf_alloc;
        CREATE TRIGGER dispenser_drop_truncated_{name} BEFORE TRUNCATE ON leaf_alloc
            FOR EACH STATEMENT EXECUTE FUNCTION {function}()
        """


MIGRATIONS: Final[tuple[Migration, ...]] = (
    Migration(
        1,
        "Leaf's segment table",
        # Leaf's MySQL table, column for column (timestamptz for MySQL's timestamp, which is UTC-based).
        """
        CREATE TABLE IF NOT EXISTS leaf_alloc (
            biz_tag     varchar(128) PRIMARY KEY,
            max_id      bigint       NOT NULL DEFAULT 1,
            step        int          NOT NULL,
            description varchar(256),
            update_time timestamptz  NOT NULL DEFAULT now()
        )
        """,
    ),
    Migration(
        2,
        "consumption-rate peaks, so a restarted worker sizes its first segment from the peak",
        """
        CREATE TABLE IF NOT EXISTS dispenser_rate_peak (
            biz_tag     varchar(128)     NOT NULL,
            kind        varchar(16)      NOT NULL,
            peak        double precision NOT NULL,
            peak_at     timestamptz      NOT NULL,
            update_time timestamptz      NOT NULL DEFAULT now(),
            PRIMARY KEY (biz_tag, kind)
        )
        """,
    ),
    Migration(
        3,
        "answers to requests with a request_id, so that a retry on any worker gets the same IDs",
        """
        CREATE TABLE IF NOT EXISTS dispenser_request (
            kind       varchar(16)  NOT NULL,
            biz_tag    varchar(128) NOT NULL,
            request_id varchar(128) NOT NULL,
            count      bigint       NOT NULL,
            format     varchar(8)   NOT NULL,
            ranges     bigint[]     NOT NULL,
            expires_at timestamptz  NOT NULL,
            PRIMARY KEY (kind, biz_tag, request_id)
        );
        CREATE INDEX IF NOT EXISTS dispenser_request_expires_at ON dispenser_request (expires_at)
        """,
    ),
    Migration(
        4,
        "removed tags' high water, so that a tag removed and added again never hands out its IDs twice",
        # A table beside leaf_alloc (which stays Leaf's, column for column). The triggers cover every writer,
        # Leaf's own tools and psql included: a DELETE records the row's max_id (the highest kept if the
        # tag is removed again), and an INSERT below it is refused. `dispenser tag add` checks first, to
        # say so plainly (TagStartTooLow). The race with a remove still uncommitted is NOT closed here (the
        # INSERT's check reads before the DELETE commits): version 6 closes it, and TRUNCATE and renames.
        """
        CREATE TABLE IF NOT EXISTS dispenser_removed_tag (
            biz_tag    varchar(128) PRIMARY KEY,
            max_id     bigint       NOT NULL,
            removed_at timestamptz  NOT NULL DEFAULT now()
        );
        CREATE OR REPLACE FUNCTION dispenser_remember_removed_tag() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO dispenser_removed_tag AS r (biz_tag, max_id, removed_at)
            VALUES (OLD.biz_tag, OLD.max_id, now())
            ON CONFLICT (biz_tag) DO UPDATE SET max_id = GREATEST(r.max_id, EXCLUDED.max_id), removed_at = now();
            RETURN OLD;
        END $$;
        CREATE OR REPLACE FUNCTION dispenser_refuse_reissue() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            high_water bigint;
        BEGIN
            SELECT max_id INTO high_water FROM dispenser_removed_tag WHERE biz_tag = NEW.biz_tag;
            IF high_water IS NOT NULL AND NEW.max_id < high_water THEN
                RAISE EXCEPTION 'tag % was removed at max_id %: a start below it would hand out its IDs again',
                    NEW.biz_tag, high_water
                    USING ERRCODE = 'check_violation', HINT = format('start at %s or above', high_water);
            END IF;
            RETURN NEW;
        END $$;
        DROP TRIGGER IF EXISTS dispenser_remember_removed_tag ON leaf_alloc;
        CREATE TRIGGER dispenser_remember_removed_tag AFTER DELETE ON leaf_alloc
            FOR EACH ROW EXECUTE FUNCTION dispenser_remember_removed_tag();
        DROP TRIGGER IF EXISTS dispenser_refuse_reissue ON leaf_alloc;
        CREATE TRIGGER dispenser_refuse_reissue BEFORE INSERT ON leaf_alloc
            FOR EACH ROW EXECUTE FUNCTION dispenser_refuse_reissue()
        """,
    ),
    Migration(
        5,
        "residue classes: a tag's stride and offset, for a database per datacenter (docs/datacenters.md)",
        # Beside leaf_alloc, which stays Leaf's column for column: a tag without a row here is Leaf's (stride 1,
        # offset 0). Leaf ignores this table, so Leaf must not serve a tag that has a row in it.
        """
        CREATE TABLE IF NOT EXISTS dispenser_tag_residue (
            biz_tag  varchar(128) PRIMARY KEY,
            stride   integer      NOT NULL CHECK (stride BETWEEN 2 AND 32768),
            "offset" integer      NOT NULL CHECK ("offset" >= 0 AND "offset" < stride)
        )
        """,
    ),
    Migration(
        6,
        "a tag's life cycle race-free: removes and adds of one tag take turns, TRUNCATE and renames keep high water",
        # Every path that removes a name from leaf_alloc (DELETE, an UPDATE of biz_tag) takes the tag's
        # transaction-scoped advisory lock before it touches the row; every path that adds one (INSERT, an
        # UPDATE of biz_tag) takes it before it reads the tombstone. So a remove still uncommitted (a psql
        # session, a commit waiting for a synchronous standby) finishes first, and the read, a statement of
        # its own under READ COMMITTED, has a snapshot that sees its tombstone. Under REPEATABLE READ or
        # SERIALIZABLE the transaction's snapshot may predate a remove committed since: a probe of the
        # tombstone's key (ON CONFLICT DO NOTHING, undone) raises serialization_failure for a row it cannot
        # see, and the retry sees it. TRUNCATE fires no row trigger: a statement trigger records every row
        # (leaf_alloc is locked ACCESS EXCLUSIVE by then, so no writer is in progress), and is refused under
        # a snapshot older than the statement (it could miss the latest max_id). The advisory key is
        # (TAG_LOCK_CLASS, hashtext(biz_tag)): two tags whose hashes collide only take turns.
        f"""
        CREATE OR REPLACE FUNCTION dispenser_lock_removed_tag() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_advisory_xact_lock({TAG_LOCK_CLASS}, hashtext(OLD.biz_tag));
            IF TG_OP = 'DELETE' THEN
                RETURN OLD;
            END IF;
            RETURN NEW;
        END $$;
        CREATE OR REPLACE FUNCTION dispenser_refuse_reissue() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            high_water bigint;
        BEGIN
            PERFORM pg_advisory_xact_lock({TAG_LOCK_CLASS}, hashtext(NEW.biz_tag));
            IF current_setting('transaction_isolation') <> 'read committed' THEN
                BEGIN
                    INSERT INTO dispenser_removed_tag (biz_tag, max_id) VALUES (NEW.biz_tag, NEW.max_id)
                        ON CONFLICT (biz_tag) DO NOTHING;
                    RAISE SQLSTATE 'LD001';  -- undo the probe's row; only a serialization failure leaves
                EXCEPTION WHEN SQLSTATE 'LD001' THEN
                    NULL;
                END;
            END IF;
            SELECT max_id INTO high_water FROM dispenser_removed_tag WHERE biz_tag = NEW.biz_tag;
            IF high_water IS NOT NULL AND NEW.max_id < high_water THEN
                RAISE EXCEPTION 'tag % was removed at max_id %: a start below it would hand out its IDs again',
                    NEW.biz_tag, high_water
                    USING ERRCODE = 'check_violation', HINT = format('start at %s or above', high_water);
            END IF;
            RETURN NEW;
        END $$;
        CREATE OR REPLACE FUNCTION dispenser_remember_truncated_tags() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('transaction_isolation') <> 'read committed' THEN
                RAISE EXCEPTION 'TRUNCATE leaf_alloc under % isolation could miss the latest max_id of a tag',
                    current_setting('transaction_isolation')
                    USING ERRCODE = 'object_not_in_prerequisite_state',
                          HINT = 'run it under READ COMMITTED (the default)';
            END IF;
            INSERT INTO dispenser_removed_tag AS r (biz_tag, max_id, removed_at)
            SELECT biz_tag, max_id, now() FROM leaf_alloc
            ON CONFLICT (biz_tag) DO UPDATE SET max_id = GREATEST(r.max_id, EXCLUDED.max_id), removed_at = now();
            RETURN NULL;
        END $$;
        DROP TRIGGER IF EXISTS dispenser_lock_removed_tag ON leaf_alloc;
        CREATE TRIGGER dispenser_lock_removed_tag BEFORE DELETE ON leaf_alloc
            FOR EACH ROW EXECUTE FUNCTION dispenser_lock_removed_tag();
        DROP TRIGGER IF EXISTS dispenser_lock_renamed_tag ON leaf_alloc;
        CREATE TRIGGER dispenser_lock_renamed_tag BEFORE UPDATE OF biz_tag ON leaf_alloc
            FOR EACH ROW WHEN (OLD.biz_tag IS DISTINCT FROM NEW.biz_tag)
            EXECUTE FUNCTION dispenser_lock_removed_tag();
        DROP TRIGGER IF EXISTS dispenser_refuse_rename_reissue ON leaf_alloc;
        CREATE TRIGGER dispenser_refuse_rename_reissue BEFORE UPDATE OF biz_tag ON leaf_alloc
            FOR EACH ROW WHEN (OLD.biz_tag IS DISTINCT FROM NEW.biz_tag)
            EXECUTE FUNCTION dispenser_refuse_reissue();
        DROP TRIGGER IF EXISTS dispenser_remember_renamed_tag ON leaf_alloc;
        CREATE TRIGGER dispenser_remember_renamed_tag AFTER UPDATE OF biz_tag ON leaf_alloc
            FOR EACH ROW WHEN (OLD.biz_tag IS DISTINCT FROM NEW.biz_tag)
            EXECUTE FUNCTION dispenser_remember_removed_tag();
        DROP TRIGGER IF EXISTS dispenser_remember_truncated_tags ON leaf_alloc;
        CREATE TRIGGER dispenser_remember_truncated_tags BEFORE TRUNCATE ON leaf_alloc
            FOR EACH STATEMENT EXECUTE FUNCTION dispenser_remember_truncated_tags()
        """,
    ),
    Migration(
        7,
        "daily tags: a tag's counter width and time zone (docs/daily.md)",
        # Beside leaf_alloc, which stays Leaf's column for column: a tag without a row here is not daily. A
        # daily tag's counters are rows of leaf_alloc of their own, '<tag>@YYYYMMDD', created on first use.
        """
        CREATE TABLE IF NOT EXISTS dispenser_tag_daily (
            biz_tag   varchar(128) PRIMARY KEY,
            width     integer      NOT NULL CHECK (width BETWEEN 1 AND 10),
            time_zone text         NOT NULL
        )
        """,
    ),
    Migration(
        8,
        "unused IDs returned on a clean stop, handed out again before new ones (docs/segment.md)",
        # Beside leaf_alloc, which stays Leaf's column for column. A row is a range of a tag's IDs that a
        # worker was granted and never handed out (first_id..last_id, members of the tag's class by stride
        # and offset), kept until one fetch takes it (DELETE ... RETURNING under FOR UPDATE SKIP LOCKED).
        # seq orders the returns: a worker remembers the highest it took, so that a database restored from
        # before that take cannot hand the range out twice. A tag removed or renamed (DELETE, UPDATE of
        # biz_tag, TRUNCATE) drops its rows in the same transaction: they never come back after a re-add.
        # The return itself takes the tag's advisory lock, so a remove and a return take turns.
        """
        CREATE TABLE IF NOT EXISTS dispenser_returned_range (
            seq         bigserial    PRIMARY KEY,
            biz_tag     varchar(128) NOT NULL,
            first_id    bigint       NOT NULL CHECK (first_id >= 0),
            last_id     bigint       NOT NULL,
            stride      integer      NOT NULL DEFAULT 1,
            "offset"    integer      NOT NULL DEFAULT 0,
            worker      text         NOT NULL,
            returned_at timestamptz  NOT NULL DEFAULT now(),
            CHECK (last_id >= first_id)
        );
        CREATE INDEX IF NOT EXISTS dispenser_returned_range_tag ON dispenser_returned_range (biz_tag, first_id);"""
        + _dropped_with_tag("dispenser_returned_range", "returned_ranges"),
    ),
    Migration(
        9,
        "ordered tags: one owner at a time by a lease row, strictly increasing across the fleet (docs/ordered.md)",
        # Beside leaf_alloc, which stays Leaf's column for column: a tag with a row here is ordered. The row is
        # its lease: holder and epoch taken by a conditional UPDATE once expires_at (the database's clock) has
        # passed; lease_ttl is the operator's (tag set --lease). A tag removed or renamed (DELETE, UPDATE of
        # biz_tag, TRUNCATE) drops its row: a re-added tag is not ordered until told again.
        """
        CREATE TABLE IF NOT EXISTS dispenser_tag_ordered (
            biz_tag    varchar(128) PRIMARY KEY,
            lease_ttl  double precision NOT NULL DEFAULT 3.0 CHECK (lease_ttl >= 0.3 AND lease_ttl <= 600),
            holder     text,
            epoch      bigint       NOT NULL DEFAULT 0,
            expires_at timestamptz  NOT NULL DEFAULT '-infinity'
        );"""
        + _dropped_with_tag("dispenser_tag_ordered", "ordered"),
    ),
    Migration(
        10,
        "permuted tags: a tag with a row is answered permuted, never plain (docs/permuted.md)",
        # Beside leaf_alloc, which stays Leaf's column for column: a tag with a row here is permuted, and a
        # worker without its key file refuses it rather than hand out its counters plain. The keys are in
        # the workers' key files, never here. A tag removed or renamed (DELETE, UPDATE of biz_tag, TRUNCATE)
        # drops its row: a re-added tag is not permuted unless told again.
        """
        CREATE TABLE IF NOT EXISTS dispenser_tag_permuted (
            biz_tag  varchar(128) PRIMARY KEY,
            added_at timestamptz  NOT NULL DEFAULT now()
        );"""
        + _dropped_with_tag("dispenser_tag_permuted", "permuted"),
    ),
)
"""Every migration, in version order. Append new versions; never edit a released one."""

LOCK_KEY: Final = 0x6C65_6166_6469_7370
"""``pg_advisory_xact_lock`` key serialising migrations (the bytes of ``leafdisp``)."""

LOCK_TIMEOUT: Final = 1.0
"""Seconds a migration waits for a table lock (``lock_timeout``) before it rolls back and tries again.

Every fetch that comes after a DDL statement in PostgreSQL's lock queue waits behind it, so this is how long
one attempt can hold the fleet's fetches: below ``postgres.command_timeout`` (2 s), so that they wait and
succeed rather than time out."""

LOCK_RETRY_FOR: Final = 60.0
"""Seconds a migration keeps trying to take its locks before it gives up (nothing applied)."""

_BACKOFF_INITIAL, _BACKOFF_CAP = 0.2, 5.0
"""Between attempts (doubling, jittered): fetches run freely meanwhile."""

_CREATE_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS dispenser_schema_version (
    version    int         PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

_Target: TypeAlias = "str | asyncpg.Connection[Any]"


@contextlib.asynccontextmanager
async def _connection(target: _Target, command_timeout: float) -> AsyncIterator[asyncpg.Connection[Any]]:
    if not isinstance(target, str):
        yield target
        return
    try:
        conn = await connect_to_primary(target, timeout=command_timeout, command_timeout=command_timeout)
    except ValueError as exc:
        if isinstance(exc, OSError):
            raise  # a TLS failure (ssl's errors are both): the database is unavailable
        raise invalid_settings(exc, *_where(target)) from None
    try:
        yield conn
    finally:
        await conn.close(timeout=command_timeout)


def _where(target: _Target) -> tuple[str, tuple[str, ...]]:
    if isinstance(target, str):
        return redact(target), dsn_secrets(target)
    return "the given connection", ()


async def migrate(
    target: _Target,
    *,
    migrations: Sequence[Migration] = MIGRATIONS,
    command_timeout: float = 60.0,
    lock_timeout: float = LOCK_TIMEOUT,
    lock_retry_for: float = LOCK_RETRY_FOR,
    clock: Clock | None = None,
) -> list[int]:
    """Apply the migrations the database has not seen yet.

    Each attempt runs the pending migrations in one transaction with ``lock_timeout`` on every table lock
    they take: a DDL statement queued behind a long transaction would otherwise hold every later fetch
    behind it. An attempt that times out on a lock is rolled back whole and tried again after a back-off,
    for ``lock_retry_for`` seconds.

    Args:
        target: a DSN (a connection is opened and closed) or an open asyncpg connection (not in a
            transaction).
        migrations: the migrations to apply; the default is this release's.
        command_timeout: seconds to connect, and for each statement, including the wait for another process's
            migration to finish (that wait is not bounded by ``lock_timeout``).
        lock_timeout: seconds one attempt waits for a table lock.
        lock_retry_for: seconds of attempts before giving up.
        clock: whose time the back-off and ``lock_retry_for`` are (tests may pass a manual one).

    Returns:
        The versions applied by this call, in order; empty when the schema was already up to date.

    Raises:
        StoreUnavailable: PostgreSQL could not be reached, a migration failed, or its locks could not be taken
            within ``lock_retry_for`` (in every case nothing was applied).
        ValueError: two migrations share a version, a timeout is not positive, or the DSN is malformed.
    """
    ordered = sorted(migrations, key=lambda m: m.version)
    versions = [m.version for m in ordered]
    if len(set(versions)) != len(versions):
        raise ValueError(f"migration versions must be unique, got {versions}")
    if lock_timeout <= 0 or lock_retry_for < 0:
        raise ValueError(
            f"need lock_timeout > 0 and lock_retry_for >= 0, got {lock_timeout}, {lock_retry_for}"
        )
    clock = clock or SystemClock()
    where, secrets = _where(target)
    with map_store_errors("migrating the schema", where=where, secrets=secrets, timeout=command_timeout):
        async with _connection(target, command_timeout) as conn:
            backoff = Backoff(_BACKOFF_INITIAL, _BACKOFF_CAP, clock=clock, jitter=0.2)
            give_up_at = clock.monotonic() + lock_retry_for
            attempts = 0
            while True:
                attempts += 1
                try:
                    return await _apply(conn, ordered, lock_timeout)
                except asyncpg.LockNotAvailableError as exc:
                    if clock.monotonic() + backoff.delay >= give_up_at:
                        raise StoreUnavailable(
                            f"migrating the schema ({where}): could not take a lock on a table within "
                            f"{lock_timeout:g} s in {attempts} attempt(s) over {lock_retry_for:g} s: a long "
                            f"transaction holds it (find it with pg_stat_activity and pg_blocking_pids); "
                            f"nothing was applied. End that transaction, or run `dispenser migrate` again "
                            f"(--lock-retry-for to try longer)"
                        ) from exc
                    log.warning(
                        "migrating the schema (%s): waits for a lock held by another transaction (%s); "
                        "rolled back, trying again in %.1f s so that fetches are not held meanwhile",
                        where,
                        exc,
                        backoff.delay,
                    )
                    await backoff.wait()


async def _apply(
    conn: asyncpg.Connection[Any], ordered: Sequence[Migration], lock_timeout: float
) -> list[int]:
    """One attempt: every pending migration in one transaction (rolled back whole if any statement fails)."""
    applied: list[int] = []
    async with conn.transaction():
        # Held until commit: a concurrent migrate waits here, then sees our versions as done. Taken before
        # the lock timeout is set, so that this wait is bounded by the statement timeout only.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
        # SET LOCAL: the transaction's only, so a connection handed in keeps its own setting.
        await conn.execute(f"SET LOCAL lock_timeout = '{round(lock_timeout * 1000)}ms'")
        await conn.execute(_CREATE_VERSION_TABLE)
        rows = await conn.fetch("SELECT version FROM dispenser_schema_version")
        done = {row["version"] for row in rows}
        for migration in ordered:
            if migration.version in done:
                continue
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO dispenser_schema_version (version, applied_at) VALUES ($1, now())",
                migration.version,
            )
            applied.append(migration.version)
    return applied


async def schema_version(target: _Target, *, command_timeout: float = 10.0) -> int:
    """Return the highest migration version applied to the database (0 when it was never migrated).

    Raises:
        StoreUnavailable: PostgreSQL could not be reached.
    """
    where, secrets = _where(target)
    with map_store_errors(
        "reading the schema version", where=where, secrets=secrets, timeout=command_timeout
    ):
        async with _connection(target, command_timeout) as conn:
            if await conn.fetchval("SELECT to_regclass('dispenser_schema_version')") is None:
                return 0
            version: int | None = await conn.fetchval("SELECT max(version) FROM dispenser_schema_version")
    return version or 0
