"""request_id across the fleet, over real NATS and PostgreSQL.

A retry that reaches another worker of the queue group gets the same IDs (segment and snowflake), and
copies racing on two workers get one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.postgres.schema import migrate
from dispenser.app import Off, Worker
from dispenser.config import Config, load_config
from dispenser_lab.servers import NatsServer, PostgresServer

from .segment_support import ask, client, ids_of, prepare, running_worker, worker_config
from .snowflake_support import snowflake_env
from .zk_support import eventually

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


def segment_config(nats_url: str, dsn: str) -> Config:
    """A segment worker (the replay store is PostgreSQL by default: ``limits.dedup_store = auto``)."""
    return worker_config(nats_url, dsn)


def snowflake_config(nats_url: str, dsn: str, state_dir: Path, worker_id: int) -> Config:
    """A snowflake-only static worker told to keep request_id answers in PostgreSQL."""
    env = snowflake_env(nats_url, state_dir, name="replay", worker_id=worker_id)
    env |= {"DISPENSER_POSTGRES_DSN": dsn, "DISPENSER_LIMITS_DEDUP_STORE": "postgres"}
    return load_config(environ=env)


@contextlib.asynccontextmanager
async def two_workers(first: Config, second: Config) -> AsyncIterator[list[Worker]]:
    """Both workers serving in the same queue group."""
    async with running_worker(first) as one, running_worker(second) as two:
        yield [one, two]


def waited(worker: Worker, kind: str) -> int:
    """Requests this worker answered on the waiting path (every request with a request_id takes it)."""
    return sum(worker.dispatchers[kind].waited)


async def race(nats_url: str, workers: list[Worker], kind: str, body: str) -> None:
    """Five request_ids, eight copies of each sent at once: one answer per request_id, from both workers."""
    keys = [f"race-{n}" for n in range(5)]
    async with client(nats_url) as nc:
        replies = await asyncio.gather(
            *(
                ask(nc, f"leaf.{kind}.order", body.replace("KEY", key).encode())
                for key in keys
                for _ in range(8)
            )
        )
    by_key: dict[str, set[tuple[int, ...]]] = {}
    for reply in replies:
        assert reply.request_id is not None
        by_key.setdefault(reply.request_id, set()).add(tuple(ids_of(reply)))
    assert sorted(by_key) == keys
    assert all(len(answers) == 1 for answers in by_key.values()), by_key
    answers = [next(iter(answers)) for answers in by_key.values()]
    everything = [i for ids in answers for i in ids]
    assert len(set(everything)) == len(everything)
    # The queue group spread the 40 copies over both workers (all on one: a 2^-39 chance).
    assert all(waited(worker, kind) > 0 for worker in workers)


async def test_segment_copies_racing_on_two_workers_get_one_answer(
    private_nats: NatsServer, pg_dsn: str
) -> None:
    """8 identical segment requests racing over two workers → one answer per request_id."""
    await prepare(pg_dsn, [("order", 1000)])
    config = segment_config(private_nats.url, pg_dsn)
    async with two_workers(config, config) as workers:
        await race(private_nats.url, workers, "segment", '{"count": 7, "request_id": "KEY"}')


async def test_snowflake_copies_racing_on_two_workers_get_one_answer(
    private_nats: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """8 identical snowflake requests racing over two workers (IDs 1 and 2) → one answer per request_id."""
    await migrate(pg_dsn)
    first = snowflake_config(private_nats.url, pg_dsn, tmp_path / "one", 1)
    second = snowflake_config(private_nats.url, pg_dsn, tmp_path / "two", 2)
    async with two_workers(first, second) as workers:
        await race(
            private_nats.url, workers, "snowflake", '{"count": 50, "format": "ranges", "request_id": "KEY"}'
        )


async def test_a_retry_after_the_answering_worker_stopped_gets_the_same_ids(
    private_nats: NatsServer, pg_dsn: str
) -> None:
    """Worker A answers and stops; the retry reaches worker B: the same IDs. A changed retry is refused."""
    await prepare(pg_dsn, [("order", 1000)])
    config = segment_config(private_nats.url, pg_dsn)
    async with running_worker(config) as second, client(private_nats.url) as nc:
        assert not isinstance(second.parts.replay_store, Off)  # the fleet-wide one, in PostgreSQL
        async with running_worker(config) as first:
            # The queue group picks the worker: send fresh request_ids until the first one has answered one.
            for n in range(64):
                body = f'{{"count": 5, "request_id": "pay-{n}"}}'.encode()
                reply = await ask(nc, "leaf.segment.order", body)
                if waited(first, "segment") > 0:
                    break
            else:
                raise AssertionError("the first worker never answered")
            key = f"pay-{n}"
        retry = await ask(nc, "leaf.segment.order", f'{{"count": 5, "request_id": "{key}"}}'.encode())
        assert ids_of(retry) == ids_of(reply)
        changed = await ask(nc, "leaf.segment.order", f'{{"count": 6, "request_id": "{key}"}}'.encode())
        assert changed.error is not None
        assert changed.error.code == "invalid"


async def test_local_dedup_store_keeps_nothing_in_postgres(private_nats: NatsServer, pg_dsn: str) -> None:
    """``limits.dedup_store = local``: no replay store (each worker remembers its own answers only)."""
    await prepare(pg_dsn, [("order", 1000)])
    config = load_config(
        environ={
            "DISPENSER_NATS_URL": private_nats.url,
            "DISPENSER_POSTGRES_DSN": pg_dsn,
            "DISPENSER_LIMITS_DEDUP_STORE": "local",
        }
    )
    async with running_worker(config) as worker, client(private_nats.url) as nc:
        assert worker.parts.replay_store == Off("limits.dedup_store")
        first = await ask(nc, "leaf.segment.order", b'{"count": 2, "request_id": "r"}')
        again = await ask(nc, "leaf.segment.order", b'{"count": 2, "request_id": "r"}')
        assert ids_of(first) == ids_of(again)
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM dispenser_request") == 0
    finally:
        await conn.close()


def prefixed(config: Config, prefix: str) -> Config:
    """``config`` on a subject prefix and queue group of its own, so that the test chooses who answers."""
    config.nats.subject_prefix = prefix
    config.nats.queue_group = prefix
    return config


async def test_by_default_no_answer_is_given_that_a_retry_elsewhere_would_not_get(
    private_nats: NatsServer, private_postgres: PostgresServer
) -> None:
    """Defaults only: a request_id that cannot be recorded is refused, and its retries get one set of IDs.

    Sent while PostgreSQL is down, it is answered ``unavailable`` (retryable), not from the buffer; its
    retry on another worker, and again on the first, gets one set of IDs. Before (``limits.dedup_unsettled = "answer"`` by default), worker A answered it with IDs it could not
    record, and the retry on worker B got other IDs.
    """
    dsn = private_postgres.dsn
    await prepare(dsn, [("order", 1000)])
    a_config = prefixed(worker_config(private_nats.url, dsn, fetch_deadline=0.5), "a")
    b_config = prefixed(worker_config(private_nats.url, dsn, fetch_deadline=0.5), "b")
    body = b'{"count": 3, "request_id": "pay-1"}'
    async with running_worker(a_config), running_worker(b_config), client(private_nats.url) as nc:
        assert ids_of(await ask(nc, "a.segment.order", b'{"count": 1}')) == [1]  # A holds [1, 1000]
        await asyncio.to_thread(private_postgres.stop)
        first = await ask(nc, "a.segment.order", body)
        await asyncio.to_thread(private_postgres.start)

        async def settled(subject: str) -> list[int]:
            reply = await ask(nc, subject, body)
            assert reply.error is None, reply.error
            return ids_of(reply)

        # B's pool notices the restart at its first statement: `unavailable` until then.
        retried = await eventually(lambda: settled("b.segment.order"), timeout=15.0, what="B's answer")
        again = await settled("a.segment.order")
    given = [ids for ids in (None if first.error else ids_of(first), retried, again) if ids is not None]
    assert len({tuple(ids) for ids in given}) == 1, given
    assert first.error is not None
    assert (first.error.code, first.error.retryable) == ("unavailable", True)
