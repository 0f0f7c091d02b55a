"""Ordered tags end to end (issue 31 item 3): real NATS and PostgreSQL, three workers, one owner at a time.

What these tests can see: every reply reaches this process on one NATS connection, so the order of receipt
is the order in which the NATS server delivered them; the server keeps one publisher's order, and only the
lease holder publishes an ordered tag's IDs, so receipt order is the owner's answer order. Replies in flight
at the same moment are ordered by the owner's answers, not by when their callers sent the requests (no
order between concurrent requests is promised or could be seen).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import asyncpg
import msgspec
import nats
import pytest
from nats.aio.client import Client

from dispenser.adapters.nats.micro import ERROR_CODE_HEADER, ERROR_HEADER
from dispenser.adapters.postgres.ordered import set_ordered
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.app import Worker
from dispenser.app.ordered import Ordered
from dispenser.cli import main
from dispenser.config import Config, load_config
from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer
from dispenser_lab.servers.process import free_port
from tests.secret_values import SECRETS

from .nats_auth_support import documented_permissions
from .segment_support import ask, client, ids_of, prepare, running_worker, spawned, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

TAG = "ord"
SUBJECT = f"leaf.segment.{TAG}"


async def cli(*args: str) -> int:
    return await asyncio.to_thread(main, list(args))


def config(nats_url: str, dsn: str) -> Config:
    return load_config(environ={"DISPENSER_NATS_URL": nats_url, "DISPENSER_POSTGRES_DSN": dsn})


async def ordered_tag(dsn: str, lease: float, step: int = 20) -> None:
    await prepare(dsn, [(TAG, step), ("plain", step)])
    async with await PostgresSegmentStore.connect(dsn) as store:
        await set_ordered(store, TAG, lease)


async def lease_row(dsn: str) -> asyncpg.Record:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT holder, epoch, expires_at > clock_timestamp() AS held FROM dispenser_tag_ordered "
            "WHERE biz_tag = $1",
            TAG,
        )
    finally:
        await conn.close()
    assert row is not None
    return row


def routes(worker: Worker) -> Ordered:
    assert isinstance(worker.ordered, Ordered)
    return worker.ordered


async def caller(nc: Client, received: list[list[int]], n: int) -> None:
    """``n`` requests one after another; each reply's IDs appended the moment it is received."""
    for _ in range(n):
        received.append(ids_of(await ask(nc, SUBJECT, b'{"count": 3}')))


async def keep_asking(nc: Client, received: list[list[int]], stop: asyncio.Event) -> None:
    """Ask until ``stop``, keeping each successful reply's IDs as received; retry the rest, as a caller would.

    A failover's error replies (503, retryable), timeouts and "no responders" are retried.
    """
    while not stop.is_set():
        try:
            msg = await nc.request(SUBJECT, b'{"count": 2}', timeout=0.5)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            continue
        if msg.headers and ERROR_HEADER in msg.headers:
            assert msg.headers[ERROR_CODE_HEADER] == "503", msg.headers  # retryable: no owner right now
            await asyncio.sleep(0.01)  # paces the retries of a caller told to retry
            continue
        received.append(ids_of(msgspec.json.decode(msg.data, type=Reply)))


def assert_strictly_increasing(received: list[list[int]]) -> None:
    """Every reply's IDs increase, and each reply's lowest ID lies above every ID received before it."""
    highest = -1
    for i, ids in enumerate(received):
        assert ids == sorted(set(ids)), (i, ids)
        assert ids[0] > highest, f"reply {i}: {ids} not above {highest} (received before)"
        highest = ids[-1]


async def test_concurrent_callers_through_three_workers_get_strictly_increasing_ids(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Six callers at once, spread over three workers: each reply's IDs lie above all received before.

    The two workers that do not own the tag forwarded to the owner, which alone answered; HTTP requests
    (Leaf's API) go to the owner over NATS too.
    """
    await ordered_tag(pg_dsn, lease=3.0)
    cfg = config(nats_server.url, pg_dsn)
    port = free_port()
    with_http = load_config(
        environ={
            "DISPENSER_NATS_URL": nats_server.url,
            "DISPENSER_POSTGRES_DSN": pg_dsn,
            "DISPENSER_HTTP_PORT": str(port),
        }
    )
    async with (
        running_worker(cfg) as a,
        running_worker(cfg) as b,
        running_worker(with_http) as c,
        client(nats_server.url) as nc,
    ):
        workers = [routes(w) for w in (a, b, c)]
        await wait_until(
            lambda: sum(w.tags[TAG].serving() for w in workers) == 1, what="one owner", timeout=10
        )
        await wait_until(
            lambda: sum(w.tags[TAG].elsewhere for w in workers) == 2, what="the others know it", timeout=5
        )
        received: list[list[int]] = []
        await asyncio.gather(*(caller(nc, received, 40) for _ in range(6)))
        assert len(received) == 240
        assert_strictly_increasing(received)
        owner = next(w for w in workers if w.tags[TAG].serving())
        assert owner.routes[TAG].answered == 240
        assert sum(w.routes[TAG].forwarded for w in workers if w is not owner) > 0

        # HTTP (Leaf's API on worker c, whichever owns the tag) and NATS, one after the other: still above.
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            for _ in range(5):
                async with session.get(f"/api/segment/get/{TAG}") as response:
                    assert response.status == 200, await response.text()
                    received.append([int(await response.text())])
                received.append(ids_of(await ask(nc, SUBJECT, b'{"count": 2}')))
        assert_strictly_increasing(received)
        assert owner.routes[TAG].answered == 250


async def owned_by(dsn: str, pid: int) -> bool:
    row = await lease_row(dsn)
    return bool(row["held"]) and row["holder"] is not None and row["holder"].split(":")[1] == str(pid)


async def failover(nats_server: NatsServer, dsn: str, tmp_path: Path, sig: signal.Signals) -> tuple[int, int]:
    """A spawned owner, an in-process second worker, callers asking throughout; ``sig`` to the owner.

    Returns:
        The lease's epoch before and after, and asserts the IDs received increase strictly throughout.
    """
    await ordered_tag(dsn, lease=1.0)
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_LOG_LEVEL": "INFO",
    }
    log = tmp_path / "owner.log"
    async with (
        spawned([sys.executable, "-m", "dispenser", "serve"], env, log) as proc,
        client(nats_server.url) as nc,
    ):
        for _ in range(300):  # its start (up to ~30 s on a loaded machine), then its lease
            assert proc.returncode is None, log.read_text()
            if await owned_by(dsn, proc.pid):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the spawned worker never owned the tag: {log.read_text()}")
        before = (await lease_row(dsn))["epoch"]
        async with running_worker(config(nats_server.url, dsn)) as second:
            mine = routes(second)
            await wait_until(lambda: mine.tags[TAG].elsewhere, what="the second worker sees the owner")
            received: list[list[int]] = []
            stop = asyncio.Event()
            callers = [asyncio.create_task(keep_asking(nc, received, stop)) for _ in range(3)]
            await wait_until(lambda: len(received) >= 30, what="answers from the first owner")
            at_signal = len(received)
            os.kill(proc.pid, sig)
            await wait_until(mine.tags[TAG].serving, what="the second worker owns the tag")
            await wait_until(lambda: len(received) >= at_signal + 30, what="answers from the second owner")
            stop.set()
            await asyncio.gather(*callers)
            assert mine.routes[TAG].answered > 0
            assert_strictly_increasing(received)
            after = (await lease_row(dsn))["epoch"]
        code = await asyncio.wait_for(proc.wait(), 10)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), log.read_text()
    return before, after


async def test_an_owner_killed_the_next_continues_strictly_above(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """The owner SIGKILLed while callers ask: the next owner's IDs lie above every ID received before.

    The other worker takes the lease once it has expired; the dead owner's unused buffer is a gap.
    """
    before, after = await failover(nats_server, pg_dsn, tmp_path, signal.SIGKILL)
    assert after == before + 1


async def test_sigterm_hands_the_tag_over(nats_server: NatsServer, pg_dsn: str, tmp_path: Path) -> None:
    """SIGTERM to the owner: it gives the lease up and exits 0; the next owner continues strictly above."""
    before, after = await failover(nats_server, pg_dsn, tmp_path, signal.SIGTERM)
    assert after == before + 1


async def lease_ttl(dsn: str, tag: str) -> float | None:
    conn = await asyncpg.connect(dsn)
    try:
        ttl: float | None = await conn.fetchval(
            "SELECT lease_ttl FROM dispenser_tag_ordered WHERE biz_tag = $1", tag
        )
    finally:
        await conn.close()
    return ttl


async def test_tag_add_and_set_ordered(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tag add --ordered --lease`, `tag set --ordered --lease`, `tag set --plain`; the clashes are refused."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "o", "--step", "10", "--ordered", "--lease", "1.5") == 0
    assert "added ordered tag 'o'" in capsys.readouterr().out
    assert await lease_ttl(pg_dsn, "o") == 1.5
    assert await cli("tag", "set", "o", "--ordered", "--lease", "2") == 0
    assert await lease_ttl(pg_dsn, "o") == 2.0
    capsys.readouterr()
    assert await cli("tag", "list") == 0
    assert "[ordered, lease 2 s]" in next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("o ")
    )
    assert await cli("tag", "set", "o", "--plain") == 0
    assert await lease_ttl(pg_dsn, "o") is None
    assert await cli("tag", "add", "d", "--step", "10", "--daily") == 0
    assert await cli("tag", "set", "d", "--ordered") != 0
    assert "daily tag" in capsys.readouterr().err
    assert await cli("tag", "set", "o", "--lease", "2") == 2
    assert "add --ordered" in capsys.readouterr().err
    assert await cli("tag", "add", "x", "--step", "10", "--ordered", "--daily") == 2
    assert await cli("tag", "set", "o", "--ordered", "--lease", "0.1") != 0
    assert "--lease must be between" in capsys.readouterr().err
    assert await cli("tag", "set", "nope", "--ordered") != 0
    assert "unknown tag" in capsys.readouterr().err


async def test_a_tag_made_plain_is_served_plain_within_a_poll(nats_server: NatsServer, pg_dsn: str) -> None:
    """`tag set --plain` on a running fleet: each worker takes the tag back to its plain path, above."""
    await ordered_tag(pg_dsn, lease=1.0)
    async with (
        running_worker(config(nats_server.url, pg_dsn)) as worker,
        client(nats_server.url) as nc,
    ):
        ordered = routes(worker)
        await wait_until(ordered.tags[TAG].serving, what="the worker owns the tag")
        before = ids_of(await ask(nc, SUBJECT, b'{"count": 2}'))
        async with await PostgresSegmentStore.connect(pg_dsn) as store:
            await set_ordered(store, TAG, None)
        await wait_until(lambda: TAG not in ordered.known, what="the tag back on the plain path")
        assert TAG not in ordered.routes
        after = ids_of(await ask(nc, SUBJECT, b'{"count": 2}'))
        assert after[0] > before[-1]
        assert TAG not in ordered.terms


async def test_the_documented_permissions_let_the_workers_forward(pg_dsn: str, tmp_path: Path) -> None:
    """docs/security.md's NATS config verbatim: an ordered tag's requests are forwarded and answered in order.

    The order service's requests reach either of two workers; the owner answers (forwarded on
    leaf.ordered.<tag>, replies through allow_responses); no permissions violation in the server's log.
    """
    await prepare(pg_dsn, [("order", 20)])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        await set_ordered(store, "order", 3.0)
    server = NatsServer(
        tmp_path / "nats",
        config=documented_permissions(),
        env={
            "DISPENSER_PASS": SECRETS["nats_dispenser_password"],
            "ORDERS_PASS": SECRETS["nats_orders_password"],
            "OPS_PASS": SECRETS["nats_ops_password"],
        },
    )
    with server:
        cfg = load_config(
            environ={
                "DISPENSER_NATS_URL": server.url,
                "DISPENSER_NATS_USER": "dispenser",
                "DISPENSER_NATS_PASSWORD": SECRETS["nats_dispenser_password"],
                "DISPENSER_POSTGRES_DSN": pg_dsn,
            }
        )
        async with running_worker(cfg) as a, running_worker(cfg) as b:
            both = [routes(a), routes(b)]
            await wait_until(
                lambda: sum(w.tags["order"].elsewhere for w in both) == 1, what="an owner, known"
            )
            orders = await nats.connect(
                server.url,
                user="orders",
                password=SECRETS["nats_orders_password"],
                inbox_prefix="_INBOX_orders",
            )
            try:
                received = [
                    ids_of(await ask(orders, "leaf.segment.order", b'{"count": 2}')) for _ in range(20)
                ]
            finally:
                await orders.close()
            assert sum(w.routes["order"].forwarded for w in both) > 0
    assert_strictly_increasing(received)
    assert "Violation" not in server.log_path.read_text()


async def test_a_removed_tag_is_ordered_no_more(pg_dsn: str) -> None:
    """Removing, renaming or truncating drops the lease row (schema version 9): a re-added tag is plain."""
    await prepare(pg_dsn, [("a", 10), ("b", 10), ("c", 10)])
    async with await PostgresSegmentStore.connect(pg_dsn) as store:
        for tag in ("a", "b", "c"):
            await set_ordered(store, tag, 2.0)
        await store.remove_tag("a")
        await store.add_tag("a", 10, 100)
    assert await lease_ttl(pg_dsn, "a") is None
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("UPDATE leaf_alloc SET biz_tag = 'b2' WHERE biz_tag = 'b'")
        assert await conn.fetchval("SELECT count(*) FROM dispenser_tag_ordered") == 1  # c's
        await conn.execute("TRUNCATE leaf_alloc")
        assert await conn.fetchval("SELECT count(*) FROM dispenser_tag_ordered") == 0
    finally:
        await conn.close()
