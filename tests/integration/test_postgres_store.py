"""The Postgres segment store against a real server: migrations, outages, timeouts, and secrets."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import AsyncIterator
from datetime import datetime

import asyncpg
import pytest

from dispenser.adapters.postgres.errors import dsn_secrets
from dispenser.adapters.postgres.schema import MIGRATIONS, Migration, migrate, schema_version
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.config import redact
from dispenser.core.errors import StoreUnavailable
from dispenser.core.segment import Segment
from dispenser_lab.servers import PostgresServer

from .segment_support import wait_until

pytestmark = pytest.mark.postgres

# Leaf's MySQL table as a Leaf user would have carried it to PostgreSQL: timestamp without time zone,
# description nullable, the sample row from Leaf's README.
LEAF_TABLE = """
CREATE TABLE leaf_alloc (
    biz_tag     varchar(128) NOT NULL DEFAULT '' PRIMARY KEY,
    max_id      bigint       NOT NULL DEFAULT 1,
    step        int          NOT NULL,
    description varchar(256) DEFAULT NULL,
    update_time timestamp    NOT NULL DEFAULT CURRENT_TIMESTAMP
);
INSERT INTO leaf_alloc (biz_tag, max_id, step, description)
VALUES ('leaf-segment-test', 1, 2000, 'Test leaf Segment Mode Get Id');
INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('order', 90001, 500);
"""


async def _fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresSegmentStore]:
    """A store on a fresh migrated database."""
    await migrate(pg_dsn)
    store = await PostgresSegmentStore.connect(pg_dsn)
    yield store
    await store.close()


# -- migrations ----------------------------------------------------------------------------------------


async def test_migrate_is_idempotent(pg_dsn: str) -> None:
    """The first migrate applies every version and records them; the second applies nothing."""
    versions = [m.version for m in MIGRATIONS]
    assert await schema_version(pg_dsn) == 0
    assert await migrate(pg_dsn) == versions
    assert await migrate(pg_dsn) == []
    assert await schema_version(pg_dsn) == versions[-1]
    rows = await _fetch(pg_dsn, "SELECT version, applied_at FROM dispenser_schema_version ORDER BY version")
    assert [r["version"] for r in rows] == versions
    assert isinstance(rows[0]["applied_at"], datetime)


async def test_migrate_creates_leaf_compatible_table(pg_dsn: str) -> None:
    """Version 1 creates leaf_alloc with Leaf's columns, types, defaults and primary key."""
    await migrate(pg_dsn)
    columns = await _fetch(
        pg_dsn,
        """SELECT column_name, data_type, character_maximum_length, is_nullable, column_default
             FROM information_schema.columns WHERE table_name = 'leaf_alloc' ORDER BY ordinal_position""",
    )
    assert [tuple(c) for c in columns] == [
        ("biz_tag", "character varying", 128, "NO", None),
        ("max_id", "bigint", None, "NO", "1"),
        ("step", "integer", None, "NO", None),
        ("description", "character varying", 256, "YES", None),
        ("update_time", "timestamp with time zone", None, "NO", "now()"),
    ]
    [pk] = await _fetch(
        pg_dsn,
        """SELECT a.attname FROM pg_index i
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
            WHERE i.indrelid = 'leaf_alloc'::regclass AND i.indisprimary""",
    )
    assert pk["attname"] == "biz_tag"


async def test_migrate_applies_only_new_versions(pg_dsn: str) -> None:
    """With a later version added, migrate applies just that one, and schema_version reports it."""
    assert await migrate(pg_dsn) == [m.version for m in MIGRATIONS]
    new = MIGRATIONS[-1].version + 1
    later = (*MIGRATIONS, Migration(new, "test table", "CREATE TABLE dispenser_test_v2 (x int)"))
    assert await migrate(pg_dsn, migrations=later) == [new]
    assert await migrate(pg_dsn, migrations=later) == []
    assert await schema_version(pg_dsn) == new
    assert await _fetch(pg_dsn, "SELECT * FROM dispenser_test_v2") == []


async def test_failed_migration_applies_nothing(pg_dsn: str) -> None:
    """A migration that fails rolls back every pending version, its earlier statements included."""
    broken = (
        *MIGRATIONS,
        Migration(
            MIGRATIONS[-1].version + 1,
            "half",
            "CREATE TABLE dispenser_half (x int); SELECT no_such_function()",
        ),
    )
    with pytest.raises(StoreUnavailable, match="no_such_function"):
        await migrate(pg_dsn, migrations=broken)
    assert await schema_version(pg_dsn) == 0
    [row] = await _fetch(
        pg_dsn, "SELECT to_regclass('dispenser_half') AS half, to_regclass('leaf_alloc') AS leaf"
    )
    assert (row["half"], row["leaf"]) == (None, None)


async def test_migrate_rejects_duplicate_versions(pg_dsn: str) -> None:
    """Two migrations with one version number are a programming error (ValueError)."""
    with pytest.raises(ValueError, match="unique"):
        await migrate(pg_dsn, migrations=(*MIGRATIONS, Migration(1, "again", "SELECT 1")))


async def test_migrate_on_an_open_connection(pg_dsn: str) -> None:
    """Both migrate and schema_version take an open connection, and leave it open."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await migrate(conn) == [m.version for m in MIGRATIONS]
        assert await schema_version(conn) == MIGRATIONS[-1].version
        assert not conn.is_closed()
    finally:
        await conn.close()


async def test_migrate_keeps_existing_leaf_table(pg_dsn: str) -> None:
    """Migrating a database that already has Leaf's table keeps the table and its rows, and serves them."""
    await _execute(pg_dsn, LEAF_TABLE)
    before = await _fetch(pg_dsn, "SELECT * FROM leaf_alloc ORDER BY biz_tag")
    assert await migrate(pg_dsn) == [m.version for m in MIGRATIONS]
    assert await _fetch(pg_dsn, "SELECT * FROM leaf_alloc ORDER BY biz_tag") == before
    store = await PostgresSegmentStore.connect(pg_dsn)
    try:
        tags = await store.list_tags()
        assert [(t.tag, t.max_id, t.step, t.description) for t in tags] == [
            ("leaf-segment-test", 1, 2000, "Test leaf Segment Mode Get Id"),
            ("order", 90001, 500, ""),
        ]
        assert all(t.update_time.tzinfo is not None for t in tags)
        assert (await store.next_segment("order")).segment == Segment(90001, 90500)
        assert (await store.next_segment("leaf-segment-test")).segment == Segment(1, 2000)
        info = await store.add_tag("new", step=10)
        assert info.max_id == 1
    finally:
        await store.close()


async def test_concurrent_migrates_are_safe(pg_dsn: str) -> None:
    """Eight migrations racing on an empty database: one applies every version, the rest wait and apply none."""
    versions = [m.version for m in MIGRATIONS]
    results = await asyncio.gather(*(migrate(pg_dsn) for _ in range(8)))
    assert sorted(results) == [[]] * 7 + [versions]
    rows = await _fetch(pg_dsn, "SELECT version FROM dispenser_schema_version ORDER BY version")
    assert [r["version"] for r in rows] == versions


async def test_peaks_are_saved_and_loaded(pg_dsn: str) -> None:
    """Version 2's table keeps each tag's peak and when it was seen; the last save wins; unmigrated: none."""
    store = await PostgresSegmentStore.connect(pg_dsn)
    try:
        assert await store.load_peaks("segment") == {}  # no table yet: no peaks, no error
        await migrate(pg_dsn)
        await store.save_peaks(
            "segment", {"order": (1234.5, 1_700_000_000.25), "pay": (10.0, 1_700_000_001.0)}
        )
        await store.save_peaks("segment", {"order": (99.0, 1_700_000_100.0)})
        await store.save_peaks("snowflake", {"order": (5.0, 1_700_000_000.0)})
        assert await store.load_peaks("segment") == {
            "order": (99.0, 1_700_000_100.0),
            "pay": (10.0, 1_700_000_001.0),
        }
        assert await store.load_peaks("snowflake") == {"order": (5.0, 1_700_000_000.0)}
    finally:
        await store.close()


async def test_unmigrated_database_says_so(pg_dsn: str) -> None:
    """A store on a database without leaf_alloc raises StoreUnavailable that points at the migration."""
    store = await PostgresSegmentStore.connect(pg_dsn)
    try:
        with pytest.raises(StoreUnavailable, match="migrat"):
            await store.next_segment("order")
    finally:
        await store.close()


# -- outages and timeouts ------------------------------------------------------------------------------


async def test_store_down_then_back(private_postgres: PostgresServer) -> None:
    """With PostgreSQL stopped every call raises StoreUnavailable; once restarted, the same store serves."""
    dsn = private_postgres.dsn
    await migrate(dsn)
    store = await PostgresSegmentStore.connect(dsn, max_size=2, connect_timeout=2.0)
    try:
        await store.add_tag("order", step=100)
        assert (await store.next_segment("order")).segment == Segment(1, 100)
        private_postgres.stop()
        for _ in range(3):
            with pytest.raises(StoreUnavailable, match="fetching the next segment of 'order'"):
                await store.next_segment("order")
        with pytest.raises(StoreUnavailable):
            await store.list_tags()
        private_postgres.start()
        assert (await store.next_segment("order")).segment == Segment(101, 200)
        assert [t.tag for t in await store.list_tags()] == ["order"]
    finally:
        await store.close()


async def test_restart_between_calls_is_invisible(private_postgres: PostgresServer) -> None:
    """A restart while the store is idle costs no failed call: the pool replaces its dropped connections."""
    dsn = private_postgres.dsn
    await migrate(dsn)
    store = await PostgresSegmentStore.connect(dsn, min_size=2, max_size=2)
    try:
        await store.add_tag("order", step=10)
        await store.next_segment("order")
        private_postgres.stop()
        # The event loop sees the server close the idle connections (the pool's own count, as asyncpg
        # has it: the store shows no pool of its own).
        pool = store._pool
        assert pool is not None
        await wait_until(lambda: pool.get_size() == 0, what="the pool's connections seen closed")
        private_postgres.start()
        segments = await asyncio.gather(*(store.next_segment("order") for _ in range(4)))
        assert sorted(a.segment.first for a in segments) == [11, 21, 31, 41]
    finally:
        await store.close()


async def test_crash_never_reissues(private_postgres: PostgresServer) -> None:
    """After kill -9 and crash recovery, the next segment lies above every segment granted before."""
    dsn = private_postgres.dsn
    await migrate(dsn)
    store = await PostgresSegmentStore.connect(dsn, connect_timeout=2.0)
    try:
        await store.add_tag("order", step=10)
        granted = [(await store.next_segment("order")).segment for _ in range(20)]
        private_postgres.kill()
        with pytest.raises(StoreUnavailable):
            await store.next_segment("order")
        private_postgres.start()
        after = (await store.next_segment("order")).segment
        assert after.first > max(s.last for s in granted)
    finally:
        await store.close()


async def test_connect_to_a_down_server(private_postgres: PostgresServer) -> None:
    """Connecting raises StoreUnavailable naming the server when nothing listens."""
    dsn = private_postgres.dsn
    private_postgres.stop()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{private_postgres.port}"):
        await PostgresSegmentStore.connect(dsn, connect_timeout=2.0)


async def test_slow_statement_times_out_and_store_recovers(pg_dsn: str) -> None:
    """A row locked elsewhere makes next_segment time out (StoreUnavailable); once freed, it works again."""
    await migrate(pg_dsn)
    store = await PostgresSegmentStore.connect(pg_dsn, max_size=1, command_timeout=0.3)
    blocker = await asyncpg.connect(pg_dsn)
    try:
        await store.add_tag("order", step=10)
        async with blocker.transaction():
            await blocker.execute("SELECT * FROM leaf_alloc WHERE biz_tag = 'order' FOR UPDATE")
            with pytest.raises(StoreUnavailable, match=r"no answer within|TimeoutError"):
                await store.next_segment("order")
        assert (await store.next_segment("order")).segment == Segment(1, 10)
    finally:
        await blocker.close()
        await store.close()


# -- secrets -------------------------------------------------------------------------------------------


def _with_password(dsn: str, password: str, database: str | None = None) -> str:
    head, _, rest = dsn.partition("@")
    dsn = f"{head}:{password}@{rest}"
    if database is not None:
        dsn = dsn.rsplit("/", 1)[0] + "/" + database
    return dsn


def _chain(exc: BaseException) -> str:
    """The messages a traceback of ``exc`` prints: its own and those of the chain it shows."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None:
        parts += traceback.format_exception_only(seen)
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "".join(parts)


def test_dsn_redaction() -> None:
    """Messages show DSNs with every password masked, and dsn_secrets finds each password asyncpg would use."""
    assert redact("postgresql://leaf:s3cr%40t@db:5432/ids?sslmode=require") == (
        "postgresql://leaf:***@db:5432/ids?sslmode=require"
    )
    assert redact("postgresql://leaf@db/ids?password=pw&sslmode=require") == (
        "postgresql://leaf@db/ids?password=***&sslmode=require"
    )
    assert redact("postgresql://db/ids?sslpassword=keypw") == "postgresql://db/ids?sslpassword=***"
    assert redact("postgresql://db/ids") == "postgresql://db/ids"
    assert set(dsn_secrets("postgresql://leaf:s3cr%40t@db/ids?password=other&sslpassword=keypw")) == {
        "s3cr%40t",
        "s3cr@t",
        "other",
        "keypw",
    }


async def test_messages_never_show_the_password(
    private_postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No error message, cause, repr or log line shows the DSN's password, even when the server echoes it."""
    caplog.set_level(logging.DEBUG)
    password = "Hunter2-db"
    # The database is named like the password, so the server's own error message contains it.
    with pytest.raises(StoreUnavailable) as missing:
        await PostgresSegmentStore.connect(_with_password(private_postgres.dsn, password, password))
    assert "does not exist" in str(missing.value)
    assert password not in _chain(missing.value)

    dsn = _with_password(private_postgres.dsn, password)
    await migrate(dsn)
    store = await PostgresSegmentStore.connect(dsn, connect_timeout=2.0)
    try:
        assert password not in repr(store)
        assert ":***@" in repr(store)
        await store.add_tag("order", step=10)
        private_postgres.stop()
        errors: list[BaseException] = []
        for call in (store.next_segment("order"), store.list_tags(), store.add_tag("x", step=1)):
            with pytest.raises(StoreUnavailable) as down:
                await call
            errors.append(down.value)
        with pytest.raises(StoreUnavailable) as migrating:
            await migrate(dsn, command_timeout=2.0)
        errors.append(migrating.value)

        def reconnects_failed() -> int:
            return sum("restore the pool connection floor" in r.getMessage() for r in caplog.records)

        # The pool's background reconnects fail and log (twice: a retry's record too), with the DSN at hand.
        await wait_until(lambda: reconnects_failed() >= 2, what="two failed reconnects logged")
        private_postgres.start()
        await store.next_segment("order")
    finally:
        await store.close()
    for error in errors:
        assert password not in _chain(error)
        assert ":***@" in str(error)
    assert password not in caplog.text


async def test_wrong_password_is_reported_without_it(private_postgres: PostgresServer) -> None:
    """With password authentication on, a wrong password fails as StoreUnavailable that hides it."""
    private_postgres.psql("CREATE ROLE leaf LOGIN PASSWORD 'right-pass'")
    hba = private_postgres.datadir / "pg_hba.conf"
    hba.write_text("host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
    private_postgres.psql("SELECT pg_reload_conf()")
    base = private_postgres.dsn.replace("postgres@", "leaf@")
    wrong = "wrong-pass-123"
    with pytest.raises(StoreUnavailable, match="password authentication failed") as failed:
        await PostgresSegmentStore.connect(_with_password(base, wrong), connect_timeout=2.0)
    assert wrong not in _chain(failed.value)
    store = await PostgresSegmentStore.connect(_with_password(base, "right-pass"))
    await store.close()


async def test_malformed_dsn_is_a_value_error_without_password() -> None:
    """A malformed DSN raises ValueError (no retry can help) whose message hides the password."""
    with pytest.raises(ValueError, match="invalid connection settings") as bad:
        await PostgresSegmentStore.connect("postgresql://leaf:pw-in-port@127.0.0.1:pw-in-port/db")
    assert "pw-in-port" not in _chain(bad.value)


async def test_the_removed_tags_high_water_holds_for_every_writer_of_leaf_alloc(pg_dsn: str) -> None:
    """Leaf's own SQL (its admin tools, psql) keeps working on leaf_alloc; re-adding a removed tag below is refused.

    The tombstone table beside leaf_alloc is kept by triggers, so a DELETE and an INSERT that bypass the
    dispenser are covered too.
    """
    await migrate(pg_dsn)
    conn = await asyncpg.connect(pg_dsn)
    try:
        # Leaf's statements, as Leaf runs them.
        await conn.execute(
            "INSERT INTO leaf_alloc (biz_tag, max_id, step, description) VALUES ('leaf', 1, 1000, '')"
        )
        await conn.execute("UPDATE leaf_alloc SET max_id = max_id + step WHERE biz_tag = 'leaf'")
        assert await conn.fetchval("SELECT max_id FROM leaf_alloc WHERE biz_tag = 'leaf'") == 1001
        await conn.execute("DELETE FROM leaf_alloc WHERE biz_tag = 'leaf'")
        assert await conn.fetchval("SELECT max_id FROM dispenser_removed_tag WHERE biz_tag = 'leaf'") == 1001
        with pytest.raises(asyncpg.CheckViolationError, match="start at 1001 or above"):
            await conn.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('leaf', 1, 1000)")
        await conn.execute("INSERT INTO leaf_alloc (biz_tag, max_id, step) VALUES ('leaf', 1001, 1000)")
    finally:
        await conn.close()
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        assert (await store.next_segment("leaf")).segment == Segment(1001, 2000)
