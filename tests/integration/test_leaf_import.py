"""`dispenser import-leaf` against a real MariaDB holding Leaf's own leaf_alloc, and a real PostgreSQL.

Leaf's servers are played by Leaf's own statements (``LeafMySQL.fetch``): a current segment, a prefetched
next one, steps adapted as ``SegmentIDGenImpl`` adapts them. After the import, the dispenser's first IDs of
each tag must lie above every ID those segments hold, by the margin the import promises.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from dispenser.adapters.mysql.leaf import LeafDatabaseError, read_leaf_alloc
from dispenser.cli import main
from dispenser.core.leaf_import import LEAF_MAX_STEP
from dispenser_lab.servers import free_port
from tests.integration.leaf_support import LEAF_SAMPLE_ROW, LeafMySQL
from tests.secret_values import SECRETS

pytestmark = [pytest.mark.postgres, pytest.mark.mariadb]


async def run(args: list[str]) -> int:
    """`dispenser ARGS` in a thread (the CLI runs its own event loop)."""
    return await asyncio.to_thread(main, args)


@pytest.fixture
async def dispenser_db(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The dispenser's PostgreSQL, migrated, as DISPENSER_POSTGRES_DSN."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await run(["migrate"]) == 0
    return pg_dsn


async def first_ids(pg_dsn: str, tags: list[str]) -> dict[str, tuple[int, int]]:
    """Each tag's first segment from the dispenser's store (as a worker fetches it), ``(first, last)``."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        out = {}
        for tag in tags:
            segment = (await store.next_segment(tag)).segment
            out[tag] = (segment.first, segment.last)
        return out


async def tag_rows(pg_dsn: str) -> dict[str, tuple[int, int, str]]:
    """The dispenser's tags: ``{tag: (max_id, step, description)}``."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        return {t.tag: (t.max_id, t.step, t.description) for t in await store.list_tags()}


async def test_every_tag_starts_above_what_leaf_granted_and_holds(
    leaf_mysql: LeafMySQL, dispenser_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Leaf's sample row, a busy tag (current + prefetched next, doubled steps) and a tag whose step exceeds Leaf's MAX_STEP."""
    leaf_mysql.sql(LEAF_SAMPLE_ROW)
    leaf_mysql.add("order", 1000, description="orders")
    leaf_mysql.add("huge", 5_000_000, max_id=10**12)
    held: dict[str, list[range]] = {"leaf-segment-test": [], "order": [], "huge": []}
    # A Leaf server's life on `order`: init, then each fast segment doubles the step (until MAX_STEP),
    # and the last fetch is the prefetched next segment it holds beside its current one.
    held["order"].append(leaf_mysql.fetch("order"))
    held["order"].append(leaf_mysql.fetch("order"))
    for step in (2000, 4000, 8000):
        held["order"].append(leaf_mysql.fetch("order", step))
    held["huge"].append(leaf_mysql.fetch("huge"))
    held["huge"].append(leaf_mysql.fetch("huge"))
    held["leaf-segment-test"].append(leaf_mysql.fetch("leaf-segment-test"))
    leaf_max = {tag: leaf_mysql.max_id(tag) for tag in held}
    assert leaf_max["order"] == 1 + 1000 + 1000 + 2000 + 4000 + 8000

    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn]) == 0
    out = capsys.readouterr().out
    assert "3 tag(s): 3 create" in out, out

    rows = await tag_rows(dispenser_db)
    assert rows["order"] == (leaf_max["order"] + LEAF_MAX_STEP, 1000, "orders")
    assert rows["leaf-segment-test"] == (
        leaf_max["leaf-segment-test"] + LEAF_MAX_STEP,
        2000,
        "Test leaf Segment Mode Get Id",
    )
    assert rows["huge"] == (leaf_max["huge"] + 5_000_000, 5_000_000, "")  # the margin follows a larger step
    firsts = await first_ids(dispenser_db, list(held))
    for tag, segments in held.items():
        highest_leaf_id = max(s[-1] for s in segments)
        assert highest_leaf_id == leaf_max[tag] - 1  # Leaf's max_id is exclusive
        first, _last = firsts[tag]
        assert first > highest_leaf_id
        assert first == leaf_max[tag] + max(rows[tag][1], LEAF_MAX_STEP)


async def test_dry_run_writes_nothing(
    leaf_mysql: LeafMySQL, dispenser_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    leaf_mysql.sql(LEAF_SAMPLE_ROW)
    leaf_mysql.add("order", 500)
    leaf_mysql.fetch("order")
    before = leaf_mysql.snapshot()

    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn, "--dry-run", "--margin", "10"]) == 0
    out = capsys.readouterr().out
    assert f"would create  order: first ID {501 + 10}, step 500" in out, out
    assert "dry run, nothing written: 2 tag(s): 2 create" in out
    assert await tag_rows(dispenser_db) == {}
    assert leaf_mysql.snapshot() == before  # Leaf's table is only ever read


async def test_a_second_run_changes_nothing_and_no_run_lowers_a_tag(
    leaf_mysql: LeafMySQL,
    dispenser_db: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    leaf_mysql.add("order", 100)
    leaf_mysql.add("user", 100)
    leaf_mysql.fetch("order")
    monkeypatch.setenv("LEAF_MYSQL_DSN", leaf_mysql.dsn)  # the DSN from the environment this time
    assert await run(["import-leaf", "--margin", "1000"]) == 0
    imported = await tag_rows(dispenser_db)
    assert imported["order"][0] == 101 + 1000
    capsys.readouterr()

    assert await run(["import-leaf", "--margin", "1000"]) == 0
    assert "2 tag(s): 2 unchanged" in capsys.readouterr().out
    assert await tag_rows(dispenser_db) == imported

    # Leaf went on granting after the import (a server left running): the rerun refuses, naming the tag…
    leaf_mysql.fetch("order")
    assert await run(["import-leaf", "--margin", "1000"]) == 1
    captured = capsys.readouterr()
    assert "REFUSED order: next ID 1101 < 1201" in captured.out, captured.out
    assert "1 tag(s) not imported: order" in captured.err
    assert await tag_rows(dispenser_db) == imported
    # …and --force raises it, leaving the tag that is still ahead alone.
    assert await run(["import-leaf", "--margin", "1000", "--force"]) == 0
    assert "raise   order: next ID 1101 -> 1201" in capsys.readouterr().out
    assert (await tag_rows(dispenser_db))["order"][0] == 1201

    # The dispenser serves past the safe start: a forced run with a small margin lowers nothing.
    await first_ids(dispenser_db, ["order"])
    assert await run(["import-leaf", "--margin", "0", "--force", "--tags", "order"]) == 0
    assert "1 tag(s): 1 unchanged" in capsys.readouterr().out
    assert (await tag_rows(dispenser_db))["order"][0] == 1201 + 100


async def test_a_subset_of_tags_and_tags_the_dispenser_cannot_take(
    leaf_mysql: LeafMySQL, dispenser_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    leaf_mysql.add("order", 10)
    leaf_mysql.add("user", 10)
    leaf_mysql.add("bad tag!", 10)  # fine for Leaf's HTTP path, not a NATS subject token
    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn, "--tags", "user", "--margin", "0"]) == 0
    assert set(await tag_rows(dispenser_db)) == {"user"}
    capsys.readouterr()

    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn, "--tags", "user,nope"]) == 1
    where = f"127.0.0.1:{leaf_mysql.server.port}/{leaf_mysql.database}"
    assert capsys.readouterr().err.strip() == f"dispenser: not in leaf_alloc of {where}: nope"

    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn, "--margin", "0"]) == 1
    captured = capsys.readouterr()
    assert "INVALID bad tag!: Leaf's tag 'bad tag!' is not a valid dispenser tag name" in captured.out
    assert "1 tag(s) not imported: bad tag!" in captured.err
    assert set(await tag_rows(dispenser_db)) == {"order", "user"}  # the valid ones are imported


async def test_errors_are_one_line(
    leaf_mysql: LeafMySQL, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unreachable MySQL, a database without Leaf's table, wrong credentials, an unmigrated dispenser, bad input."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    server = leaf_mysql.server
    closed = free_port()
    # A reader of Leaf's table as a migration would use: SELECT on it, nothing else.
    user, password, wrong = "leafreader", SECRETS["leaf_mysql_password"], SECRETS["leaf_mysql_wrong_password"]
    server.sql(
        f"CREATE OR REPLACE USER '{user}'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"GRANT SELECT ON `{leaf_mysql.database}`.leaf_alloc TO '{user}'@'127.0.0.1'"
    )
    reader = server.dsn_for(leaf_mysql.database, user=user, password=password)
    assert await run(["import-leaf", "--mysql", reader, "--dry-run"]) == 1  # read fine; PostgreSQL unmigrated
    assert "run `dispenser migrate` first" in capsys.readouterr().err
    cases = [
        (
            ["--mysql", f"mysql://root@127.0.0.1:{closed}/leaf"],
            1,
            f"cannot reach Leaf's MySQL at 127.0.0.1:{closed}",
        ),
        (["--mysql", server.dsn_for("nosuchdb")], 1, "has no database 'nosuchdb'"),
        (["--mysql", server.dsn_for("mysql")], 1, f"no table leaf_alloc in 127.0.0.1:{server.port}/mysql"),
        (
            ["--mysql", server.dsn_for(leaf_mysql.database, user=user, password=wrong)],
            1,
            f"refused user {user!r}",
        ),
        (["--mysql", "postgresql://x@y/z"], 2, "not a MySQL DSN"),
        (["--mysql", f"mysql://root@127.0.0.1:{server.port}/"], 2, "names no database"),
        (["--mysql", leaf_mysql.dsn, "--tags", ","], 2, "--tags names no tag"),
        ([], 2, "give Leaf's database with --mysql DSN or $LEAF_MYSQL_DSN"),
        # Leaf's side is fine; the dispenser's database was never migrated.
        (["--mysql", leaf_mysql.dsn], 1, "run `dispenser migrate` first"),
    ]
    for args, status, message in cases:
        assert await run(["import-leaf", *args]) == status, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert len(err.strip().splitlines()) == 1, (args, err)  # one line, no traceback
        assert wrong not in err
    # argparse's own refusal: the usage line, then the reason.
    with pytest.raises(SystemExit) as exited:
        main(["import-leaf", "--mysql", leaf_mysql.dsn, "--margin", "-1"])
    assert exited.value.code == 2
    assert "argument --margin: must be 0 or more, got -1" in capsys.readouterr().err


async def test_leafs_first_ddl_with_desc_is_read_too(
    leaf_mysql: LeafMySQL, dispenser_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first published DDL named the description column `desc` (Leaf's 2017 article)."""
    leaf_mysql.sql("ALTER TABLE leaf_alloc CHANGE description `desc` varchar(256) DEFAULT NULL")
    leaf_mysql.add_row("order", 100, 7, "orders", column="desc")
    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn, "--margin", "0"]) == 0
    assert await tag_rows(dispenser_db) == {"order": (7, 100, "orders")}


async def test_a_mysql_that_never_answers_times_out() -> None:
    """A port that accepts connections and says nothing (a hung server, a black-holing proxy)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(LeafDatabaseError, match=f"at 127.0.0.1:{port} did not answer within 0.5 s"):
            await read_leaf_alloc(f"mysql://root@127.0.0.1:{port}/leaf", timeout=0.5)
        assert time.monotonic() - started < 5


async def test_a_tag_removed_here_above_leafs_ids_starts_above_both(
    leaf_mysql: LeafMySQL, dispenser_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tag the dispenser once served and removed (its high water kept) is imported above that, not refused."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    leaf_mysql.add("order", 1000)
    async with await PostgresSegmentStore.connect(dispenser_db) as store:
        await store.add_tag("order", 100, start=10**9)
        await store.next_segment("order")
        await store.remove_tag("order")  # IDs up to 10**9 + 99 were handed out here
    assert await run(["import-leaf", "--mysql", leaf_mysql.dsn]) == 0
    assert "first ID 1000000100" in capsys.readouterr().out
    assert (await first_ids(dispenser_db, ["order"]))["order"][0] == 10**9 + 100
