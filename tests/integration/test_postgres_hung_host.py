"""A PostgreSQL host that accepts connections and never answers (SIGSTOP), on plain servers: no wait past a deadline.

What a frozen VM or a partition looks like, unlike a killed server whose kernel refuses at once: the listen
backlog takes the TCP connection, and nothing ever comes back. asyncpg alone tries a DSN's hosts in order
under one shared timeout, so such a host listed first hid the live primary after it for good. The Patroni
version of these (the frozen leader, first in the DSN, with a real failover) is tests/ha/test_hung_primary.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from shutil import copytree, ignore_patterns

import pytest

from dispenser.adapters.postgres.schema import MIGRATIONS, migrate, schema_version
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable
from dispenser_lab.servers import DevServerError, NatsServer, PostgresServer, frozen
from tests.integration.segment_support import ask, client, ids_of, prepare, running_worker, worker_config

pytestmark = pytest.mark.postgres


@pytest.fixture
def other_postgres(tmp_path: Path, _postgres_template: Path) -> Iterator[PostgresServer]:
    """A second private PostgreSQL server (the other host of a two-host DSN)."""
    datadir = tmp_path / "pgdata-other"
    copytree(_postgres_template, datadir, symlinks=True, ignore=ignore_patterns("postgres.log"))
    server = PostgresServer(datadir)
    try:
        server.start()
    except DevServerError as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def two_hosts(first: PostgresServer, second: PostgresServer) -> str:
    """The multi-host read-write DSN of the ``postgres`` database on both servers, ``first`` first."""
    return (
        f"postgresql://postgres@127.0.0.1:{first.port},127.0.0.1:{second.port}/postgres"
        "?target_session_attrs=read-write"
    )


def pid(server: PostgresServer) -> int:
    assert server.pid is not None
    return server.pid


async def test_a_frozen_first_host_does_not_hide_the_live_primary_after_it(
    private_postgres: PostgresServer, other_postgres: PostgresServer, nats_server: NatsServer
) -> None:
    """The worker starts and answers its first request from the second host at once (was: never).

    Before, every connection attempt spent the whole connect timeout on the frozen first host and never
    reached the second: the worker answered `unavailable` for as long as the first host stayed frozen.
    """
    await prepare(other_postgres.dsn, [("order", 100)])
    config = worker_config(nats_server.url, two_hosts(private_postgres, other_postgres), fetch_deadline=2.0)
    with frozen(pid(private_postgres)):
        started = time.monotonic()
        async with running_worker(config) as worker, client(nats_server.url) as nc:
            assert worker.postgres.start_error is None
            sent = time.monotonic()
            reply = await ask(nc, "leaf.segment.order", b'{"count": 5}', timeout=5.0)
            answered = time.monotonic()
    assert reply.error is None, reply.error
    assert ids_of(reply) == [1, 2, 3, 4, 5]
    # Far below the 5 s connect timeout the frozen host used to take from every attempt.
    assert sent - started < 2.0, sent - started
    assert answered - sent < 0.5, answered - sent


async def test_a_fetch_stuck_on_a_host_that_stops_answering_is_dropped_and_the_next_goes_elsewhere(
    private_postgres: PostgresServer, other_postgres: PostgresServer
) -> None:
    """Abandoned within ``command_timeout``; the next fetch reaches the other primary, and so does the one after.

    The pool holds two connections to the first host when it freezes: the stuck one is terminated (a
    plain release would wait for the frozen server to acknowledge the cancellation), and the idle one is
    replaced rather than tried (it would hang for another ``command_timeout``).
    """
    first, second = private_postgres, other_postgres
    await prepare(first.dsn, [("order", 10)])
    await migrate(second.dsn)
    async with await PostgresSegmentStore.connect(second.dsn) as store:
        await store.add_tag("order", 10, start=1_000_001)  # the second host's IDs are told apart
    with frozen(pid(second)):  # so that the pool's connections all go to the first host
        store = await PostgresSegmentStore.connect(
            two_hosts(first, second), min_size=2, command_timeout=1.0, connect_timeout=5.0
        )
    try:
        assert (await store.next_segment("order")).segment.first == 1
        with frozen(pid(first)):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.next_segment("order")
            stuck = time.monotonic() - started
            fetched = []
            for _ in range(3):
                started = time.monotonic()
                fetched.append((await store.next_segment("order")).segment.first)
                assert time.monotonic() - started < 0.4, time.monotonic() - started
        # command_timeout and CANCEL_GRACE (0.25 s), not twice command_timeout as the wait for a cancellation took
        assert 1.0 <= stuck < 1.7, stuck
        assert fetched == [1_000_001, 1_000_011, 1_000_021]
    finally:
        await store.close()


async def test_the_first_request_at_start_is_answered_within_its_deadline_while_postgres_never_answers(
    private_postgres: PostgresServer, nats_server: NatsServer
) -> None:
    """A single host that accepts connections and never answers: `unavailable` at the request's deadline.

    Before, the first request waited for the pool's connect timeout (5.0 s for a 2 s deadline): the tag
    list lookup it set off was not bounded by the request's deadline.
    """
    await prepare(private_postgres.dsn, [("order", 100)])
    config = worker_config(nats_server.url, private_postgres.dsn, fetch_deadline=1.0)
    config.postgres.connect_timeout = 3.0
    with contextlib.ExitStack() as freezing:
        freezing.enter_context(frozen(pid(private_postgres)))
        async with client(nats_server.url) as nc, running_worker(config) as worker:
            assert worker.postgres.start_error is not None
            sent = time.monotonic()
            reply = await ask(nc, "leaf.segment.order", b'{"count": 5}', timeout=5.0)
            waited = time.monotonic() - sent
            assert reply.error is not None, reply
            assert reply.error.code == "unavailable", reply
            assert reply.error.retryable
            assert 0.9 <= waited < 1.5, waited  # the 1 s deadline, not the 3 s connect timeout
            freezing.close()  # SIGCONT
            # Resumed: the same worker serves (the lookup cut short at the deadline left nothing stuck).
            deadline = time.monotonic() + 5.0
            while (
                reply := await ask(nc, "leaf.segment.order", b'{"count": 5}', timeout=5.0)
            ).error is not None:
                assert time.monotonic() < deadline, reply.error
            assert ids_of(reply) == [1, 2, 3, 4, 5]


async def test_migrate_and_check_reach_the_primary_behind_a_frozen_first_host(
    private_postgres: PostgresServer, other_postgres: PostgresServer
) -> None:
    """`dispenser migrate` (and `check`'s schema version) open their own connection: every host at once too."""
    dsn = two_hosts(private_postgres, other_postgres)
    with frozen(pid(private_postgres)):
        started = time.monotonic()
        assert await migrate(dsn, command_timeout=10.0)
        assert await schema_version(dsn, command_timeout=10.0) == MIGRATIONS[-1].version
        took = time.monotonic() - started
    assert took < 2.0, took  # before: the whole 10 s timeout, then a failure
